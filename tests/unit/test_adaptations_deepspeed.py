"""adaptations/deepspeed.py: DeepSpeed 0.19.8 (CPU accelerator, torch 2.13) still does what each adaptation works
around, and the adaptation stops it. Each check runs in a fresh interpreter: DeepSpeed's op table, its process
group and the warnings filters are process-wide.

When a test here fails on its "upstream still..." assertion, upstream changed: read the adaptation's docstring
and remove it (or adjust it) rather than the assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]


def _child(code: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The JIT build itself (~150 s on 2 cores) is replaced by a recorder in the child: the question is whether
# DeepSpeed asks for it when it sets up its backend, which it does for any world size.
_SHM_BUILD = """
import importlib, json
import deepspeed
from deepspeed.accelerator import get_accelerator
from adaptations.deepspeed import SHM_COMM_OP, skip_shm_comm_build

ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch the attribute is torch itself
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
builds = []
type(builder).load = lambda self, *a, **k: builds.append(self.NAME) or "the op"
upstream = ds_torch.build_shm_op()  # what TorchBackend.__init__ calls, before it knows the world size
after_upstream = list(builds)
skip_shm_comm_build()
skip_shm_comm_build()  # idempotent
adapted = ds_torch.build_shm_op()
print(json.dumps({"name": builder.NAME, "key": SHM_COMM_OP, "upstream": upstream, "after_upstream": after_upstream,
                  "adapted": adapted, "builds": builds}))
"""


def test_deepspeed_still_builds_the_shm_op_for_any_world_and_skip_shm_comm_build_stops_it():
    seen = _child(_SHM_BUILD)
    assert seen["name"] == seen["key"] == "deepspeed_shm_comm"  # the key the adaptation writes is DeepSpeed's
    # upstream still: the CPU backend's set-up builds the op (it would JIT-compile it here)
    assert seen["upstream"] == "the op" and seen["after_upstream"] == ["deepspeed_shm_comm"]
    # adapted: no build, the backend gets no op and uses torch.distributed
    assert seen["adapted"] is None and seen["builds"] == ["deepspeed_shm_comm"]


_COLLECTIVES = """
import json, os, warnings
import torch
import deepspeed
import deepspeed.comm as dist
from adaptations.deepspeed import quiet_deprecated_collectives, skip_shm_comm_build

skip_shm_comm_build()
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
deepspeed.init_distributed(dist_backend="gloo")


def future_warnings(adapt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if adapt:
            quiet_deprecated_collectives()
        gathered = torch.zeros(4)
        dist.all_gather_into_tensor(gathered, torch.arange(4.0))  # what ZeRO-2/3 call on every update
        dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4))
        warnings.warn("another FutureWarning", FutureWarning)
    assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0]  # one rank: its own tensor
    return [str(w.message).split(" is deprecated")[0] for w in caught if issubclass(w.category, FutureWarning)]


print(json.dumps({"upstream": future_warnings(False), "adapted": future_warnings(True)}))
"""


def test_deepspeeds_collectives_still_warn_and_quiet_deprecated_collectives_silences_only_them():
    seen = _child(_COLLECTIVES)
    # upstream still: both collectives DeepSpeed's comm layer calls warn (torch deprecated them)
    assert seen["upstream"] == [
        "`torch.distributed.all_gather_into_tensor`",
        "`torch.distributed.reduce_scatter_tensor`",
        "another FutureWarning",
    ]
    assert seen["adapted"] == ["another FutureWarning"]  # other FutureWarnings still show


_ALLREDUCE = """
import json, os
import torch
import deepspeed
from adaptations.deepspeed import skip_shm_comm_build, skip_single_rank_allreduce

skip_shm_comm_build()
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Linear(8, 8)
config = {"train_batch_size": 1, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
reductions = []
fallback = engine.buffered_allreduce_fallback  # where stage 0 flattens and all-reduces every gradient
engine.buffered_allreduce_fallback = lambda *a, **k: reductions.append(1) or fallback(*a, **k)


def step():
    engine.backward(engine(torch.ones(1, 8)).square().sum())
    engine.step()
    return len(reductions)


upstream_flag, upstream = engine.enable_backward_allreduce, step()
switched = skip_single_rank_allreduce(engine)
adapted = step() - upstream
print(json.dumps({"flag": upstream_flag, "upstream": upstream, "switched": switched, "adapted": adapted}))
"""


def test_deepspeed_still_all_reduces_over_one_rank_at_stage_0_and_skip_single_rank_allreduce_stops_it():
    seen = _child(_ALLREDUCE)
    assert seen["flag"] is True and seen["upstream"] >= 1  # upstream still: one rank, a flatten-and-copy per step
    assert seen["switched"] is True and seen["adapted"] == 0


# What make_engine builds, ZeRO-2 and AdamW, one step: does DeepSpeed import its Muon module (and with it torch's
# inductor compiler, which nothing else here imports), and is the step the same with the stand-in?
_MUON = """
import json, os, sys
import torch
import deepspeed
from adaptations.deepspeed import MUON_MODULES, NoMuon, skip_muon_import, skip_shm_comm_build

skip_shm_comm_build()
adapt = sys.argv[1] == "adapted"
if adapt:
    assert skip_muon_import() and skip_muon_import()  # idempotent
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
config = {"train_batch_size": 1, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.ones(1, 8)).square().sum())
engine.step()
refused = []
if adapt:  # what a Muon config or a use_muon parameter would reach: each fails by name
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    for call in (lambda: MuonWithAuxAdam([]), lambda: muon_update(None, None)):
        try:
            call()
        except RuntimeError as e:
            refused.append("Muon optimizer is not loaded" in str(e))
kinds = {"stand-in" if sys.modules[name].MuonWithAuxAdam is NoMuon else "real" for name in MUON_MODULES
         if name in sys.modules}
print(json.dumps({"muon": sorted(kinds), "refused": refused,
                  "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "weight": [round(v, 6) for v in model.weight.detach().flatten().tolist()]}))
"""


def _muon_child(mode: str) -> dict:
    code = _MUON.replace("sys.argv[1]", repr(mode))
    return _child(code)


def test_deepspeed_still_imports_muon_for_an_adamw_engine_and_skip_muon_import_stands_in():
    upstream, adapted = _muon_child("upstream"), _muon_child("adapted")
    # upstream still: an AdamW ZeRO-2 engine imports the real Muon module, and torch's inductor with it
    assert upstream["muon"] == ["real"] and upstream["inductor"] is True
    # adapted: the stand-in answered, inductor never loaded, and the step moved the weights exactly the same
    assert adapted["muon"] == ["stand-in"] and adapted["inductor"] is False
    assert adapted["weight"] == upstream["weight"]
    assert adapted["refused"] == [True, True]  # building a Muon or updating a use_muon parameter: named
