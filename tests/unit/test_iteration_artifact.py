"""flows/artifacts.iteration_markdown: the text of an iteration's one Prefect artifact, checked line by line."""

from __future__ import annotations

from types import SimpleNamespace

from flows.artifacts import iteration_markdown

MANIFESTS = {
    "rollout": {"uri": "s3://b/runs/r/iter-000003/rollout", "rows": 64},
    "score": {"uri": "s3://b/runs/r/iter-000003/scored"},
    "update": {"experience_uri": "s3://b/runs/r/iter-000003/experience"},
    "checkpoint": {"uri": "s3://b/runs/r/checkpoints/iter-000003"},
}


def _cfg(name: str = "r"):
    return SimpleNamespace(run=SimpleNamespace(name=name))


def test_the_metrics_row_is_a_two_column_table_then_the_uris_follow():
    row = {"iteration": 3, "reward/mean": 0.123456789, "rollout/engine": "hf", "kl/mean": None}
    text = iteration_markdown(_cfg(), 3, row, MANIFESTS).splitlines()
    assert text[0] == "# r, iteration 3"
    table = text[text.index("| metric | value |") :]
    assert table[1] == "|---|---|"
    # 6 significant digits for floats; ints, strings and None as written
    assert table[2:6] == [
        "| iteration | 3 |",
        "| reward/mean | 0.123457 |",
        "| rollout/engine | hf |",
        "| kl/mean | None |",
    ]
    assert "- rollout shards: `s3://b/runs/r/iter-000003/rollout` (64 rows)" in text
    assert "- checkpoint: `s3://b/runs/r/checkpoints/iter-000003`" in text
    assert not any(line.startswith("- eval shards") for line in text)


def test_a_pipe_in_a_value_does_not_end_its_cell_and_eval_shards_are_listed_when_there():
    manifests = {**MANIFESTS, "eval": {"uri": "s3://b/runs/r/iter-000003/eval", "rows": 8}}
    text = iteration_markdown(_cfg(), 3, {"note": "a|b"}, manifests).splitlines()
    assert "| note | a\\|b |" in text
    assert "- eval shards: `s3://b/runs/r/iter-000003/eval` (8 rows)" in text


def test_a_time_is_shown_as_a_utc_date_not_as_six_digits():
    # Issue 56: time/finished_unix showed as 1.79589e+09. 1795890601 s after 1970-01-01 UTC: 20785 days
    # (1795824000 s) = 2026-11-28, plus 66601 s = 18:30:01.
    text = iteration_markdown(_cfg(), 3, {"time/finished_unix": 1795890601.25}, MANIFESTS).splitlines()
    assert "| time/finished_unix | 2026-11-28 18:30:01 UTC |" in text
