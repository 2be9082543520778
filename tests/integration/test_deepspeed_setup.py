"""DeepSpeed on one CPU rank: its shared-memory all-reduce op is not compiled (nothing to reduce; the build
took 35 s on 2 cores on every fresh machine), and an engine still trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

ONE_RANK = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from engines.trainer.deepspeed_setup import deepspeed_config, make_engine
    from ppoflow.config import TrainConfig
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = model.weight.detach().clone()
    config = deepspeed_config(TrainConfig(micro_batch_size=2, zero_stage=2), "float32", 2, 0.1, world=1)
    engine = make_engine(model, config, lambda step: 1.0)
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    import deepspeed.comm.comm as dist_comm
    print(json.dumps({"shm_op": dist_comm.cdb.shm_comm_op is not None,
                      "moved": bool((engine.module.weight.detach() != before).any())}))
""")


def test_one_cpu_rank_builds_no_shared_memory_comm_op(tmp_path):
    extensions = tmp_path / "torch_extensions"  # empty: any JIT build would land here
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "CUDA_VISIBLE_DEVICES": ""}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK, str(REPO)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"shm_op": False, "moved": True}
    built = [p.name for p in extensions.rglob("*") if "shm" in p.name]
    assert built == [] and "built successfully" not in proc.stdout + proc.stderr


AUTOCAST = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from engines.trainer.deepspeed_setup import deepspeed_config, make_engine
    from ppoflow.config import TrainConfig
    seen = {}
    for setting in (None, "bfloat16"):
        cfg = deepspeed_config(TrainConfig(micro_batch_size=2, zero_stage=2), "float32", 2, 0.1, setting, world=1)
        engine = make_engine(torch.nn.Linear(4, 1), cfg, lambda step: 1.0)
        seen[str(setting)] = [engine.torch_autocast_enabled(), str(engine.torch_autocast_dtype())]
    print(json.dumps(seen))
""")


def test_the_engines_keep_the_callers_autocast(tmp_path):
    """model.autocast_dtype must reach the matmuls inside a DeepSpeed engine. DeepSpeed 0.19's engine.forward
    (runtime/torch_autocast.autocast_if_enabled) runs the module with CUDA autocast switched off when the caller
    entered one and the engine's own `torch_autocast` setting is off, so on a GPU every actor and critic matmul ran
    in float32 (found on an H200: 4% MFU instead of 22%). On this CPU machine the caller's CPU autocast is not the
    one it checks, so the test reads DeepSpeed's own view of our config, the switch that decides it on a GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", AUTOCAST, str(REPO)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["None"][0] is False  # no autocast asked for: the engine enters none
    assert seen["bfloat16"] == [True, "torch.bfloat16"], seen
