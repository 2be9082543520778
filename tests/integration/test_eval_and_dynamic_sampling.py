"""The eval stage and dynamic sampling through the real pipeline (Prefect server, HF rollout, DeepSpeed CPU).

Two iterations of the toy task with eval.every = 1 and dynamic sampling on, under a 0/1 reward written here
(`parity_reward`: about half the samples score 1, so groups with and without variance both occur). Every
expected value is recomputed from the shards the run wrote, not read from the code that computed it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

EVAL_PROMPTS, EVAL_N = 5, 3


def parity_reward(queries, prompts, labels, **kwargs):
    """1 when the response's characters sum to an odd code point total, else 0 (an arbitrary fair coin)."""
    responses = [q[len(p) :] for q, p in zip(queries, prompts)]
    return [float(sum(map(ord, r)) % 2) for r in responses]


def _eval_set(path):
    from engines.toy.task import make_rows

    rows = make_rows(EVAL_PROMPTS, seed=11)
    with open(path, "w") as f:
        for prompt, label in zip(rows["prompt"], rows["label"]):
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    return str(path)


def _groups(table) -> dict[int, list[float]]:
    groups = defaultdict(list)
    for prompt, reward in zip(table.column("prompt_index").to_pylist(), table.column("reward").to_pylist()):
        groups[prompt].append(reward)
    return groups


def test_eval_rows_metrics_and_dynamic_sampling(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, monkeypatch):
    from engines import warm
    from flows.iteration import ppo_iteration
    from flows.records import read_metrics
    from flows.training import ppo_training
    from stages.policy import policy_ref
    from stages.rollout import run_rollout
    from storage.layout import layout_for
    from storage.shards import read_shards
    from storage.stage_records import read_stage_record
    from tests.fixtures.faults import count_stage_bodies

    cfg = small_config(
        str(tmp_path / "runs"),
        "evalds",
        tiny_model_dir,
        digits_dataset_dir,
        iterations=2,
        algo={"name": "grpo"},
        rollout={"prompts_per_iteration": 4, "n_samples": 2, "dynamic_sampling": {"enabled": True, "max_rounds": 4}},
        train={"train_batch_size": 4, "micro_batch_size": 4},
        reward={"sources": [{"kind": "function", "target": f"{__file__}:parity_reward"}]},
        eval={
            "data_path": _eval_set(tmp_path / "held_out.jsonl"),
            "every": 1,
            "n_samples": EVAL_N,
            "temperature": 1.0,
            "sampled_pass_at_k": "every",
        },
    )
    assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    layout = layout_for(cfg)
    rows = {row["iteration"]: row for row in read_metrics(layout)}
    assert sorted(rows) == [1, 2]
    assert sum(row["rollout/groups_dropped"] for row in rows.values()) > 0  # the filter had groups to drop

    for iteration, row in rows.items():
        evaluated = read_shards(layout.fs, layout.stage_dir(iteration, "eval"))
        assert evaluated.num_rows == EVAL_PROMPTS * EVAL_N
        assert set(evaluated.column("policy_version").to_pylist()) == {iteration}  # the policy just committed
        rewards = evaluated.column("reward").to_pylist()
        assert set(rewards) <= {0.0, 1.0}
        assert row["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
        # pass@k = mean over prompts of 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), here with math.comb
        correct = [int(sum(g)) for g in _groups(evaluated).values()]
        for k in (1, EVAL_N):
            want = sum(1 - math.comb(EVAL_N - c, k) / math.comb(EVAL_N, k) for c in correct) / len(correct)
            assert row[f"eval/pass@{k}"] == pytest.approx(want, abs=1e-12)

        # dynamic sampling: every group trained on has reward variance, and the accounting matches the rows
        trained = _groups(read_shards(layout.fs, layout.stage_dir(iteration, "experience")))
        assert trained and all(max(g) > min(g) for g in trained.values()), trained
        assert row["rollout/groups_kept"] == len(trained) and row["rollout/batch_filled"] == 1.0
        assert row["rollout/zero_variance_trained_fraction"] == 0.0
        # signal (engines/ppo/signal.py): every trained group differs; the samples with a non-zero advantage,
        # recounted from the experience shards (GRPO without KL in the reward: all of them, as the groups differ)
        experience = read_shards(layout.fs, layout.stage_dir(iteration, "experience"))
        nonzero = [any(a != 0 for a in adv) for adv in experience.column("advantages").to_pylist()]
        assert row["signal/group_spread"] == 1.0
        assert row["signal/nonzero_advantage"] == pytest.approx(sum(nonzero) / len(nonzero), abs=1e-12)
        # eval.sampled_pass_at_k = every: the rollout's sampling (n_samples 2) on the held-out prompts; properties
        # of any 0/1 rewards: pass@2 >= the per-sample accuracy, and a prompt with spread has one correct sample
        assert 0 <= row["eval/sampled_accuracy"] <= row["eval/sampled_pass@2"] <= 1
        assert row["eval/sampled_spread"] <= row["eval/sampled_pass@2"]
        assert row["rollout/groups_kept"] + row["rollout/groups_dropped"] >= 4

    # Determinism: the rollout stage run again from scratch (cold process state) writes the same rows.
    warm.invalidate()
    again = run_rollout(cfg, 2, policy_ref(cfg, 2))
    assert again.content_hash == read_stage_record(layout, 2, "rollout")["content_hash"]
    sampled = {k: v for k, v in again.metrics.items() if not k.startswith("timing/")}  # seconds differ run to run
    assert sampled == {k: v for k, v in rows[2].items() if k in sampled}
    assert again.metrics.keys() <= rows[2].keys()  # the timings too are in the row

    # A retry of iteration 2 finds every stage, eval included, in the cache and gives the same row.
    calls = count_stage_bodies(monkeypatch)
    retried = ppo_iteration(config=cfg.model_dump(mode="json"), iteration=2)
    assert sum(calls.values()) == 0, calls
    assert {k: v for k, v in retried.items() if k.startswith("eval/")} == {
        k: v for k, v in rows[2].items() if k.startswith("eval/")
    }


def test_an_eval_lost_between_commit_and_row_runs_again_on_resume(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    """Iteration 2 commits, then its eval fails (as a process dying there would leave it: committed, no eval
    record, no row). The next start of the run runs that eval again: its rows and metrics equal those of a run
    that never failed (same seed, same committed policy)."""
    import pytest as _pytest

    from flows.records import read_metrics
    from flows.training import ppo_training
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for
    from storage.shards import read_shards
    from storage.stage_records import read_stage_record
    from tests.fixtures.faults import fail_when

    def config(name):
        return small_config(
            str(tmp_path / "runs"),
            name,
            tiny_model_dir,
            digits_dataset_dir,
            iterations=2,
            eval={"data_path": _eval_set(tmp_path / "held_out.jsonl"), "every": 1, "n_samples": EVAL_N},
        )

    whole, broken = config("whole"), config("broken")
    assert ppo_training(config=whole.model_dump(mode="json"), return_state=True).is_completed()
    with _pytest.MonkeyPatch.context() as mp:
        fail_when(mp, "stages.evaluate", "run_eval", lambda cfg, iteration, *a, **k: iteration == 2)
        assert not ppo_training(config=broken.model_dump(mode="json"), return_state=True).is_completed()
    layout = layout_for(broken)
    assert latest_iteration(layout) == 2 and read_stage_record(layout, 2, "eval") is None
    assert [row["iteration"] for row in read_metrics(layout)] == [1]

    assert ppo_training(config=broken.model_dump(mode="json"), return_state=True).is_completed()
    rows = {row["iteration"]: row for row in read_metrics(layout)}
    want = {row["iteration"]: row for row in read_metrics(layout_for(whole))}
    assert sorted(rows) == [1, 2] and rows[2].get("record/rebuilt") is True
    assert {k: v for k, v in rows[2].items() if k.startswith("eval/")} == {
        k: v for k, v in want[2].items() if k.startswith("eval/")
    }
    assert rows[2]["eval/reward_mean"] is not None
    # The eval samples themselves (the shards' data; their metadata names the run, so the bytes differ).
    redone, reference = (read_shards(lay.fs, lay.stage_dir(2, "eval")) for lay in (layout, layout_for(whole)))
    assert redone.replace_schema_metadata(None).equals(reference.replace_schema_metadata(None))
