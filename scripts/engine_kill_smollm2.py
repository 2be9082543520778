"""By hand (issue 52): vLLM's EngineCore SIGKILLed in the middle of a SmolLM2 rollout is replaced within the stage.

    .venv/bin/python scripts/engine_kill_smollm2.py    # from the repository root; ~3 min: three vLLM engines

Iteration 1's rollout stage of configs/real_arithmetic.yaml (SmolLM2-135M-Instruct, vLLM, 16 prompts x 4 samples x
16 new tokens), three times in one process, each as its own run under a temporary run.root:
1. uninterrupted;
2. the EngineCore (and its worker) SIGKILLed the moment the generate's first tokens reach vLLM's client, with its
   requests still being sampled (tests/fixtures/faults.kill_engine_core_mid_generate, the fault the tiny-model test
   injects): the stage builds and attests a new engine and samples again; its rows must equal run 1's;
3. killed again in the replacement's generate too: past rollout.engine_replacements = 1 the stage fails by name
   (EngineLost).
Prints one JSON line of what it saw (kills, replacements, rows equal, the error). The fault comes from the tests'
fixtures on purpose: it is injected from outside, as a test does, and the stage code holds no hook for it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "real_arithmetic.yaml"
COLUMNS = ["prompt_ids", "response_ids", "rollout_logprobs", "sample_index", "finish_reason"]


def _rows(cfg) -> dict:
    from storage.layout import layout_for
    from storage.shards import read_shards

    layout = layout_for(cfg)
    return read_shards(layout.fs, layout.stage_dir(1, "rollout")).select(COLUMNS).to_pydict()


def main() -> dict:
    sys.path.insert(0, str(REPO))  # run as a file: the repository's packages (and tests/fixtures) by name
    import pytest

    from engines.reasoning_tasks import materialize
    from engines.rollout.registry import shutdown_all
    from ppoflow.config import load_config
    from stages.engine_replacement import EngineLost
    from stages.policy import policy_ref
    from stages.rollout import run_rollout
    from tests.fixtures.faults import kill_engine_core_mid_generate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ppoflow-engine-kill-"))
    names = ("whole", "kill", "twice")
    # the recipe's reasoning-gym prompts written as files and data.path set to them, as `ppoflow train` does first
    configs = {name: materialize(load_config(RECIPE, [f"run.root={root}", f"run.name={name}"])) for name in names}
    seen: dict = {}
    try:
        started = time.perf_counter()
        run_rollout(configs["whole"], 1, policy_ref(configs["whole"], 1))
        seen["uninterrupted_s"] = round(time.perf_counter() - started, 1)
        with pytest.MonkeyPatch.context() as patch:
            killed = kill_engine_core_mid_generate(patch, kills=1)
            started = time.perf_counter()
            manifest = run_rollout(configs["kill"], 1, policy_ref(configs["kill"], 1))
            seen["killed_once_s"] = round(time.perf_counter() - started, 1)
        seen.update(kills=killed, engine_replacements=manifest.engine_replacements, rows=manifest.rows)
        seen["attested_version"] = manifest.attested.version if manifest.attested else None
        seen["rows_equal_uninterrupted"] = _rows(configs["kill"]) == _rows(configs["whole"])
        with pytest.MonkeyPatch.context() as patch:
            killed_twice = kill_engine_core_mid_generate(patch, kills=2)
            try:
                run_rollout(configs["twice"], 1, policy_ref(configs["twice"], 1))
                seen["twice"] = "no error (the stage should have failed)"
            except EngineLost as lost:
                seen["twice"] = str(lost)
            seen["twice_kills"] = killed_twice
    finally:
        shutdown_all()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(seen), flush=True)
    return seen


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from running this again
    main()
