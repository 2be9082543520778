"""The rollout's weight attestation and the sampler-vs-trainer gap on the README recipe: one `ppoflow train` run.

    python -m bench.attestation_cost                                   # 12 iterations (~10 min on 2 idle cores)
    python -m bench.attestation_cost --iterations 2 --results-dir /tmp/smoke      # a smoke run, its line elsewhere

The run is configs/real_arithmetic.yaml (SmolLM2-135M-Instruct in float32, GRPO, vLLM rollouts, 16 prompts x 4
samples) as a subprocess (bench/real_model.run_train), without its evals (eval_size 0: the figures are the training
iterations'). Per iteration it reads:
- the rollout stage's record (storage/stage_records.py): `attested.seconds`, the attestation's wall seconds (the
  digest of the weights vLLM's worker holds, through collective_rpc, and the comparison: stages/attest.py), against
  `seconds`, the stage body's wall seconds in its worker; share = attest / stage (baseline: the stage it guards;
  the issue's budget is 2%);
- the metrics row: mismatch/logprob_abs_diff_mean, mismatch/logprob_abs_diff_max, mismatch/kl (the gate's figures:
  stages/mismatch_gate.py, measured by the trainer with the weights the rollout sampled with).
Ends with one JSON line (bench/common.py emit) appended to bench/results/attestation_cost.jsonl (or --results-dir):
the per-iteration lists, and median and max of each. A run killed past --timeout-s (a loaded machine) still reports
the iterations it finished (iterations_measured, run_error).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from bench.common import emit

GAP_KEYS = {
    "gap_mean": "mismatch/logprob_abs_diff_mean",
    "gap_max": "mismatch/logprob_abs_diff_max",
    "kl": "mismatch/kl",
}


# ---- pure helpers (tests/unit/test_bench_attestation_cost.py) --------------------------------------------------
def per_iteration(rows: list[dict], records: dict[int, dict]) -> list[dict]:
    """One entry per metrics row of iteration >= 1 whose rollout record is in `records` ({iteration: rollout stage
    record}): iteration, attest_s, rollout_stage_s, attest_share (attest_s / rollout_stage_s), and the GAP_KEYS
    present in the row. An iteration whose rollout was not attested (attested null: tensor parallelism) has no
    attest_* keys (absent, not zero)."""
    out = []
    for row in sorted((r for r in rows if r.get("iteration", 0) >= 1), key=lambda r: r["iteration"]):
        record = records.get(row["iteration"])
        if record is None:
            continue
        entry = {"iteration": row["iteration"], "rollout_stage_s": round(record["seconds"], 3)}
        if record.get("attested") is not None:
            seconds = record["attested"]["seconds"]
            entry.update(attest_s=round(seconds, 4), attest_share=round(seconds / record["seconds"], 5))
        entry.update({short: row[key] for short, key in GAP_KEYS.items() if key in row})
        out.append(entry)
    return out


def summary(entries: list[dict]) -> dict:
    """{"<key>_median", "<key>_max"} over the entries holding each of attest_s, attest_share, rollout_stage_s and
    the GAP_KEYS; a key no entry holds is absent."""
    out = {}
    for key in ("attest_s", "attest_share", "rollout_stage_s", *GAP_KEYS):
        values = [e[key] for e in entries if key in e]
        if values:
            out[f"{key}_median"], out[f"{key}_max"] = statistics.median(values), max(values)
    return out


# ---- main ----------------------------------------------------------------------------------------------------------
def measure(iterations: int, timeout_s: float) -> dict:
    from bench.real_model import RECIPE, run_train
    from ppoflow.config import load_config
    from storage.layout import RunLayout
    from storage.metrics import read_metrics
    from storage.stage_records import read_stage_record

    root = Path(tempfile.mkdtemp(prefix="ppoflow-bench-attest-"))
    sets = [f"run.root={root}", f"run.iterations={iterations}", "eval.before_training=false"]
    sets += ["data.reasoning_gym.eval_size=0"]
    failed = None
    try:
        try:
            run_train(root, sets, dict(os.environ), timeout_s)
        except RuntimeError as exc:  # killed past --timeout-s, or failed: the iterations it finished still count
            failed = str(exc).splitlines()[0]
        layout = RunLayout(str(root), load_config(RECIPE, sets).run.name)
        rows = read_metrics(layout)
        records = {i: read_stage_record(layout, i, "rollout") for i in range(1, iterations + 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    entries = per_iteration(rows, {i: r for i, r in records.items() if r is not None})
    out = {"recipe": RECIPE.name, "iterations": iterations, "iterations_measured": len(entries)}
    out.update({"run_error": failed} if failed else {})
    return {**out, "per_iteration": entries, **summary(entries)}


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=12, help="training iterations of the recipe")
    p.add_argument("--timeout-s", type=float, default=1800, help="the run is killed (and the bench fails) after")
    p.add_argument("--results-dir", type=Path, default=None, help="where the JSON line goes (default bench/results)")
    args = p.parse_args(argv)
    return emit("attestation_cost", measure(args.iterations, args.timeout_s), args.results_dir)


if __name__ == "__main__":
    main()
