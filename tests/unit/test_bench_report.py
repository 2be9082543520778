"""bench/report.py keeps the latest line of each variant of a bench (BENCHMARKS.md shows one table per variant)."""

import json

import bench.report as report
import bench.report_pages as report_pages


def _write(folder, name, lines):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_latest_keeps_one_line_per_variant_in_first_seen_order(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    _write(
        tmp_path,
        "demo",
        [
            {"storage": "local", "x": 1},
            {"storage": "s3", "x": 2},
            {"storage": "local", "x": 3},
            {"size": "tiny", "x": 4},
        ],
    )
    # local's latest is x=3 (the later of its two lines) and keeps local's first place; s3 and size=tiny
    # are variants of their own
    assert [line["x"] for line in report.latest("demo")] == [3, 2, 4]


def test_a_bench_without_results_has_no_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    assert report.latest("never-run") == []


def test_a_line_of_one_workload_does_not_hide_the_latest_line_of_another(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    _write(
        tmp_path,
        "overhead",
        [
            {"workloads": {"batch": {}, "tiny": {}}, "x": 1},
            {"workloads": {"batch": {}}, "x": 2},
            {"workloads": {"tiny": {}}, "x": 3},
            {"workloads": {"batch": {}}, "x": 4},
        ],
    )
    # three workload sets: both (x=1), batch alone (latest x=4), tiny alone (x=3)
    assert [line["x"] for line in report.latest("overhead")] == [1, 4, 3]
    assert "Latest (workloads=batch)" in report.section("overhead")


def test_an_overhead_line_from_before_workloads_were_named_counts_as_tiny(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    _write(
        tmp_path,
        "overhead",
        [
            {"bench": "overhead", "ratio": 2.3, "x": 1},  # 2026-11-21: the demo's 32 x 4 workload, unnamed
            {"bench": "overhead", "workloads": {"batch": {}}, "x": 2},
            {"bench": "overhead", "workloads": {"tiny": {}}, "x": 3},
        ],
    )
    # the old line is the tiny variant's, so the newer tiny line replaces it instead of both being listed
    assert [line["x"] for line in report.latest("overhead")] == [3, 2]


def test_the_real_model_peer_table_reads_the_peer_side_and_derives_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    assert report.peer_real_table() == ""  # not run: no table, no placeholder figures
    sides = {
        "trl_hf": {"iter_s_with_first": 40.0, "iter_s_steady": 50.0, "peak_rss_gib": 6.0},
        "ppoflow_pipeline": {"iter_s_with_first": 30.0, "iter_s_steady": 25.0, "peak_rss_gib": 9.0},
    }
    line = {"peer": "trl_hf", "sides": sides, "ratio_with_first": 0.75, "orchestration_share": 1.1, "date": "2026"}
    _write(tmp_path, "peer_real", [line])
    rows = {r.split(" | ")[0].lstrip("| "): r for r in report.peer_real_table().splitlines() if r.startswith("| ")}
    assert rows["s per iteration, first included"].endswith("| 30 | 40 | 0.75 |")  # the line's own ratio
    assert rows["s per iteration, steady"].endswith("| 25 | 50 | 0.5 |")  # 25 / 50, derived by the table
    assert rows["peak RSS, GiB"].endswith("| 9 | 6 | 1.5 |")
    assert rows["pipeline / bare engine loop (orchestration share)"].endswith("| 1.1 |  |  |")  # no TRL figure
    # a figure ppoflow's sides did not report has no row, though TRL's side reported its own half of it
    assert "held-out accuracy at equal wall time" not in rows
    assert not [what for what in rows if what.startswith("with train.optimizer_state_every=4")]


def test_a_side_whose_scores_came_from_the_cache_gets_a_caveat(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    sides = {
        "trl_hf": {"iter_s_steady": 40.0, "stage_s": {"score": 0.0}},  # TRL scores in "prepare": no caveat
        "ppoflow_pipeline": {"iter_s_steady": 32.0, "stage_s": {"score": 3.4}},
        "ppoflow_rollout_old": {"iter_s_steady": 24.0, "stage_s": {"score": 0.01}},  # under 3.4 / 10: cached
        "ppoflow_k1": {"iter_s_steady": 33.0, "stage_s": {"score": 3.0}},  # not under a tenth: no caveat
    }
    _write(tmp_path, "peer_real", [{"peer": "trl_hf", "sides": sides, "date": "2026"}])
    notes = [ln for ln in report.peer_real_table().splitlines() if ln.startswith("Caveat")]
    assert len(notes) == 1 and notes[0].startswith("Caveat: ppoflow_rollout_old's score stage took 0.01 s")
    assert "~3.39 s too low" in notes[0]  # 3.4 - 0.01


def test_benchmarks_md_is_short_and_links_every_bench_page(tmp_path, monkeypatch):
    # rendered from the repository's own results: the short page stays within 150 lines however many keys the
    # benches log, and every bench gets one paragraph linking its own page
    page = report_pages.summary_page("bench/results/", "docs/benchmarks/")
    assert len(page.splitlines()) <= 150
    for name in report.bench_names():
        [paragraph] = [ln for ln in page.splitlines() if ln.startswith(f"**{name}**: ")]
        assert paragraph.endswith(f"[All figures](docs/benchmarks/{name}.md)")
        assert f"`python -m bench.{name}`" in paragraph
    # the key-by-key dumps are on the bench pages, not here
    assert "| figure | value |" not in page


def test_a_bench_without_results_says_so_and_its_plots_are_not_linked(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "bench_names", lambda: ["score"])
    page = report_pages.summary_page("../assets/results/", "")
    assert "**score**: " in page and "not run yet on this branch" in page and "**30**" not in page
    assert "| score | warm / cold scorer speed-up | >= 20 | not yet measured |" in page  # the goals table: no number
    assert "![" not in page  # no results, no plots
    (tmp_path / "score.jsonl").write_text(json.dumps({"bench": "score", "warm_over_cold": 30.0, "date": "2026"}) + "\n")
    (tmp_path / "async_reward_vs_seconds.png").write_bytes(b"png")
    page = report_pages.summary_page("../assets/results/", "")
    assert "warm / cold scorer speed-up: **30** (goal >= 20)" in page
    assert (
        "![reward against wall time, pipelined iterations k = 0, 1, 2](../assets/results/async_reward_vs_seconds.png)"
        in page
    )


def test_a_bench_page_links_its_plots_from_the_docs_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    _write(tmp_path, "scale", [{"bench": "scale", "memory_lora_over_full": 0.5, "date": "2026"}])
    (tmp_path / "scale_memory.png").write_bytes(b"png")
    page = report_pages.bench_page("scale")
    assert page.startswith("# bench.scale\n") and "| memory_lora_over_full | 0.5 |" in page
    assert "![scale_memory](../assets/results/scale_memory.png)" in page


def test_the_nav_lists_one_page_per_bench_between_its_markers():
    yml = (
        "nav:\n  - Benchmarks:\n      - by bench:\n          # bench pages: start\n          - old: x.md\n"
        "          # bench pages: end\n  - Internals: internals.md\n"
    )
    out = report_pages.nav_with_bench_pages(yml)
    names = report.bench_names()
    assert [ln.strip() for ln in out.splitlines()[4 : 4 + len(names)]] == [
        f"- bench.{n}: benchmarks/{n}.md" for n in names
    ]
    assert "old: x.md" not in out and out.endswith("  - Internals: internals.md\n")
