"""Regenerate BENCHMARKS.md and the docs' benchmark pages from bench/results/*.jsonl: every benchmark's latest figures.

    python -m bench.report

BENCHMARKS.md (and docs/benchmarks/index.md, the same page for the docs site) is the short page: the real-model
peer table, the goals against the measured values, one paragraph per bench and the headline plots
(bench/report_pages.py). Each bench module in bench/ also gets a page of its own, docs/benchmarks/<bench>.md: its
docstring's first line, its latest JSON line per variant (date, machine, commit, every figure key by key), and
the PNG plots it left in bench/results/ (named <bench>*.png). A bench that has not been run yet is listed as
such, so no page hides one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
OUT = BENCH_DIR.parent / "BENCHMARKS.md"
NOT_BENCHES = {
    "__init__",
    "common",
    "report",
    "report_pages",
    "stage_plot",
    "plots",
    "trl_env",
    "ppoflow_side",
    "processes",
    "peer_real_sides",
    "interleave",
    "kernel_shares",  # bench.update_mfu's profile helper
    "update_flops",  # bench.update_mfu's FLOP model
    "roofline_flops",  # bench.roofline's FLOP model
}
FIRST = "peer_real"  # the real-model peer leads the page
META = ("bench", "date", "commit", "cpu_count", "machine")


def bench_names() -> list[str]:
    names = sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in NOT_BENCHES)
    return sorted(names, key=lambda n: n != FIRST)  # stable: the rest stay alphabetical


VARIANT_KEYS = (
    "algo",
    "engine",
    "size",
    "model",
    "storage",
    "dynamic_sampling",
    "experiment",
)  # a bench run per variant keeps one latest line per variant
# What a line written before its bench reported a variant key ran with (bench.learning had no dynamic sampling).
VARIANT_DEFAULTS = {"dynamic_sampling": False}
# The workload a bench's lines measured before the bench named its workloads: bench.overhead's first lines
# (2026-11-21) ran the demo's 32 x 4 rollout, which it now calls "tiny".
LEGACY_WORKLOADS = {"overhead": "tiny"}


def variant_of(line: dict) -> dict:
    """What makes a line a variant of its own: the VARIANT_KEYS it has (or their defaults), and for a bench that
    measures several workloads (bench.overhead, bench.pools) which of them the line holds, so a run of one workload
    does not hide the latest figures of another."""
    variant = {k: line[k] for k in VARIANT_KEYS if k in line}
    variant.update({k: v for k, v in VARIANT_DEFAULTS.items() if k not in line})
    if isinstance(line.get("workloads"), dict):
        variant["workloads"] = "+".join(sorted(line["workloads"]))
    elif line.get("bench") in LEGACY_WORKLOADS:
        variant["workloads"] = LEGACY_WORKLOADS[line["bench"]]
    return variant


def latest(name: str) -> list[dict]:
    """The latest line of each variant (variant_of) of a bench, oldest variant first."""
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    by_variant: dict[str, dict] = {}
    for ln in path.read_text().splitlines():
        if ln.strip():
            line = json.loads(ln)
            by_variant[json.dumps(variant_of(line), sort_keys=True)] = line
    return list(by_variant.values())


def summary(name: str) -> str:
    spec = importlib.util.find_spec(f"bench.{name}")
    if spec is None or spec.origin is None:
        return ""
    text = Path(spec.origin).read_text()
    for quote in ('"""', "'''"):
        if text.lstrip().startswith(quote):  # the docstring's first paragraph, on one line
            first = text.lstrip()[3:].split(quote, 1)[0].split("\n\n", 1)[0]
            return " ".join(first.split())
    return ""


def _flat(line: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested figure dicts (e.g. one per workload) as dotted rows: workloads.batch.ratio."""
    rows = []
    for k, v in line.items():
        if isinstance(v, dict) and v and len(json.dumps(v)) > 60:
            rows += _flat(v, f"{prefix}{k}.")
        else:
            rows.append((f"{prefix}{k}", v))
    return rows


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v)[:200] + "`"
    return str(v)


# The headline table: per bench, what its goal compares, the goal, and where the measured value sits in its
# latest line (a dotted key path; `variant` picks one variant's line). A bench without a stated goal shows its
# main figure with "no stated goal". A row whose value is missing shows "not yet measured", never a number;
# "a|b" shows two values as "a vs b".
HEADLINES = [
    (
        "peer_real",
        "ppoflow pipeline / TRL GRPO s per iteration, first included (SmolLM2-135M)",
        "<= 0.5",
        "ratio_with_first",
        {},
    ),
    (
        "peer_real",
        "held-out accuracy at equal wall time, ppoflow pipeline vs TRL",
        "ppoflow >= TRL",
        "ppoflow_accuracy_at_equal_time|trl_accuracy_at_equal_time",
        {},
    ),
    (
        "peer_real",
        "pipeline / bare engine loop s per iteration (orchestration share)",
        "<= 1.03",
        "orchestration_share",
        {},
    ),
    (
        "peer_trl",
        "ppoflow pipeline / TRL PPO s per iteration, steady (toy, small)",
        "<= 0.5",
        "ratio",
        {"size": "small"},
    ),
    (
        "peer_trl",
        "ppoflow pipeline / TRL GRPO s per iteration, steady (toy, small)",
        "<= 0.5",
        "grpo_ratio",
        {"size": "small"},
    ),
    ("overhead", "pipeline / bare engine loop s per iteration (batch workload)", "<= 1.05", "ratio", {}),
    ("pools", "warm workers / in-process s per iteration (batch)", "<= 1.15", "ratio", {}),
    ("async", "max_staleness 1 / 0 iterations per second (warm)", ">= 1.5", "warm_k1_speedup", {}),
    (
        "attestation_cost",
        "attestation / rollout stage seconds, worst iteration (SmolLM2)",
        "<= 0.02",
        "attest_share_max",
        {},
    ),
    (
        "curriculum_vs_baseline",
        "target-level held-out accuracy gain in points, curriculum vs none (SmolLM2, 30 min)",
        "curriculum >= 15",
        "curriculum.gain_points|no_curriculum.gain_points",
        {},
    ),
    (
        "learning",
        "seconds to mean reward 0.9 (toy GRPO)",
        "<= 600",
        "reached_0.9_at_s",
        {"algo": "grpo", "dynamic_sampling": False},
    ),
    ("rollout", "vLLM / HF generate tokens per second", ">= 5", "ratio_vllm_over_hf", {}),
    ("score", "warm / cold scorer speed-up", ">= 20", "warm_over_cold", {}),
    ("score", "batched / per-sample scoring speed-up", ">= 5", "batched_over_per_sample", {}),
    ("logprobs", "selective log-softmax / naive memory (forward)", "<= 0.25", "memory_ratio_forward", {}),
    ("shards", "ppoflow / raw write+read speed", ">= 0.5", "write_read_ratio", {}),
    ("update_mfu", "update MFU (GPU)", ">= 0.40", "mfu", {}),
    ("rm_peer", "ppoflow / TRL RewardTrainer s per step", "<= 0.5", "ratio", {}),
    ("rm_chain", "rule reward of the RM-trained run / the rule-trained run", ">= 0.8", "ratio", {}),
    ("real_model", "update GFLOP/s / torch.mm peak (SmolLM2-135M)", "no stated goal", "update_over_peak", {}),
    ("reward_isolation", "veRL-contract isolation / thread scoring time", "no stated goal", "verl_ratio", {}),
    ("scale", "LoRA / full update peak memory", "no stated goal", "memory_lora_over_full", {}),
    ("score_cache", "compacted / uncompacted cold lookup speed-up", "no stated goal", "cold_lookup_speedup", {}),
]


def _dig(line: dict, path: str):
    if path in line:  # a key that holds a dot itself (reached_0.9_at_s)
        return line[path]
    for part in path.split("."):
        if not isinstance(line, dict) or part not in line:
            return None
        line = line[part]
    return line


def headlines() -> list[tuple[str, str, str, str, str, str]]:
    """(bench, what, goal, measured, date, commit) per HEADLINES row, from the newest line (of the named variant)
    that holds every value; "not yet measured" and empty date and commit where none does."""
    rows = []
    for name, what, goal, path, variant in HEADLINES:
        lines = [ln for ln in latest(name) if all(ln.get(k) == v for k, v in variant.items())]
        # the newest line that holds every value (variants that do not report it are skipped)
        held = [(ln, [_dig(ln, p) for p in path.split("|")]) for ln in lines]
        held = [(ln, vs) for ln, vs in held if all(v is not None for v in vs)]
        line, value = max(held, key=lambda h: h[0].get("date", "")) if held else (None, None)
        measured = "not yet measured" if value is None else " vs ".join(_value(v) for v in value)
        date = (line or {}).get("date", "")[:10] if value is not None else ""
        commit = f"`{line.get('commit')}`" if value is not None else ""
        rows.append((name, what, goal, measured, date, commit))
    return rows


def headline_table() -> str:
    """Goal against the measured value for every bench, from the latest line (of the named variant)."""
    rows = ["| bench | what | goal | measured | date | commit |", "|---|---|---|---|---|---|"]
    rows += [f"| {' | '.join(cells)} |" for cells in headlines()]
    return "\n".join(rows) + "\n"


# The real-model peer, first and short: (what, goal, ppoflow's key, TRL's key or None, ratio key or None); keys
# are paths into the latest peer_real line, "{peer}" standing for the TRL side that was the peer.
PEER_REAL_ROWS = [
    (
        "s per iteration, first included",
        "ratio <= 0.5",
        "sides.ppoflow_pipeline.iter_s_with_first",
        "sides.{peer}.iter_s_with_first",
        "ratio_with_first",
    ),
    ("s per iteration, steady", "", "sides.ppoflow_pipeline.iter_s_steady", "sides.{peer}.iter_s_steady", "ratio"),
    (
        "s to the end of the first iteration",
        "",
        "sides.ppoflow_pipeline.to_first_iteration_s",
        "sides.{peer}.to_first_iteration_s",
        None,
    ),
    (
        "held-out accuracy at equal wall time",
        "ppoflow >= TRL",
        "ppoflow_accuracy_at_equal_time",
        "trl_accuracy_at_equal_time",
        None,
    ),
    (
        "rollout tokens per s",
        "",
        "sides.ppoflow_pipeline.rollout_tokens_per_s",
        "sides.{peer}.rollout_tokens_per_s",
        None,
    ),
    ("peak RSS, GiB", "", "sides.ppoflow_pipeline.peak_rss_gib", "sides.{peer}.peak_rss_gib", None),
    ("pipeline / bare engine loop (orchestration share)", "<= 1.03", "orchestration_share", None, None),
    (
        "with train.optimizer_state_every=4: s per iteration, first included",
        "",
        "sides.ppoflow_opt_every.iter_s_with_first",
        "sides.{peer}.iter_s_with_first",
        "ratio_opt_every_with_first",
    ),
    (
        "with train.optimizer_state_every=4: s per iteration, steady",
        "",
        "sides.ppoflow_opt_every.iter_s_steady",
        "sides.{peer}.iter_s_steady",
        "ratio_opt_every",
    ),
    (
        "with train.optimizer_state_every=4: pipeline / bare engine loop",
        "<= 1.03",
        "orchestration_share_opt_every",
        None,
        None,
    ),
    (
        "with algo.old_logprobs=rollout: s per iteration, first included",
        "",
        "sides.ppoflow_rollout_old.iter_s_with_first",
        "sides.{peer}.iter_s_with_first",
        "ratio_rollout_old_with_first",
    ),
    (
        "with algo.old_logprobs=rollout: s per iteration, steady",
        "",
        "sides.ppoflow_rollout_old.iter_s_steady",
        "sides.{peer}.iter_s_steady",
        "ratio_rollout_old",
    ),
    (
        "with algo.old_logprobs=rollout: held-out accuracy at equal wall time",
        "",
        "rollout_old_accuracy_at_equal_time.ppoflow_rollout_old",
        "rollout_old_accuracy_at_equal_time.{peer}",
        None,
    ),
]


def peer_real_table() -> str:
    """ppoflow against TRL on the real model, a table read in ten seconds; '' before peer_real has run."""
    lines = [ln for ln in latest("peer_real") if ln.get("peer")]
    if not lines:
        return ""
    line = max(lines, key=lambda ln: ln.get("date", ""))
    dig = lambda path: _dig(line, path.format(peer=line["peer"])) if path else None  # noqa: E731
    rows = [
        f"ppoflow (Prefect pipeline, in-process) against TRL's GRPOTrainer ({line['peer']}) on "
        f"SmolLM2-135M-Instruct, {line.get('recipe')}, {line.get('iterations')} iterations x {line.get('seeds')} "
        f"seeds, {line.get('threads')} threads; {line.get('date', '')[:10]}, commit `{line.get('commit')}`.",
        "",
        "| figure | goal | ppoflow | TRL | ppoflow / TRL |",
        "|---|---|---|---|---|",
    ]
    for what, goal, ours, theirs, ratio_key in PEER_REAL_ROWS:
        ours_v, theirs_v, ratio_v = dig(ours), dig(theirs), dig(ratio_key)
        if ours_v is None:  # that ppoflow side (or figure) was not in the run: no row, not TRL's figure beside nothing
            continue
        if ratio_v is None and isinstance(ours_v, (int, float)) and isinstance(theirs_v, (int, float)) and theirs_v:
            ratio_v = round(ours_v / theirs_v, 3)
        cells = [_value(v) if v is not None else "" for v in (ours_v, theirs_v, ratio_v)]
        rows.append(f"| {what} | {goal} | {' | '.join(cells)} |")
    rows += [f"\n{note}" for note in _score_cache_notes(line)]
    return "\n".join(rows) + "\n"


def _score_cache_notes(line: dict) -> list[str]:
    """A ppoflow side whose score stage took under a tenth of the pipeline side's found its scores in the cache that
    an earlier side of the same seed filled (the bench shared one run.root before it gave each run its own): its
    seconds per iteration are flattered by the difference, which the note states."""
    sides = line.get("sides") or {}  # (TRL's sides score inside their "prepare": they have no score stage)
    base = _dig(sides, "ppoflow_pipeline.stage_s.score")
    notes = []
    for side, figures in sides.items():
        score = _dig(figures, "stage_s.score")
        if not side.startswith("ppoflow_") or side == "ppoflow_pipeline" or base is None or score is None:
            continue
        if score >= base / 10:
            continue
        notes.append(
            f"Caveat: {side}'s score stage took {_value(score)} s against ppoflow_pipeline's {_value(base)} s: it "
            f"found its scores in the cache the pipeline side of the same seed had filled, so its seconds per "
            f"iteration are ~{_value(round(base - score, 2))} s too low (bench.peer_real now gives every run a root "
            f"of its own)."
        )
    return notes


def section(name: str, images: str = "bench/results/") -> str:
    """A bench's latest line of each variant, key by key, and its plots (linked under `images`)."""
    lines = [f"## {name}", "", summary(name), "", f"Run: `python -m bench.{name}`", ""]
    found = latest(name)
    if not found:
        lines += ["Not run yet on this branch.", ""]
        return "\n".join(lines)
    for line in found:
        m = line.get("machine") or {}
        variant = ", ".join(f"{k}={v}" for k, v in variant_of(line).items() if k in line)
        lines += [
            f"Latest{' (' + variant + ')' if variant else ''}: {line.get('date')} on "
            f"{m.get('cores', line.get('cpu_count'))} cores, {m.get('mem_gib', '?')} GiB, "
            f"{m.get('cpu_model', '?')}; commit `{line.get('commit')}`.",
            "",
            "| figure | value |",
            "|---|---|",
        ]
        lines += [f"| {k} | {_value(v)} |" for k, v in _flat({k: v for k, v in line.items() if k not in META})]
        lines.append("")
    for png in sorted(RESULTS.glob(f"{name}*.png")):
        lines += ["", f"![{png.stem}]({images}{png.name})"]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    from bench.report_pages import write_all

    written = write_all()
    print(json.dumps({"bench": "report", "written": [str(p) for p in written], "benches": bench_names()}))


if __name__ == "__main__":
    main()
