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


# What make_engine builds, ZeRO-2 and AdamW, one step, with the stand-ins in place and each read of them recorded:
# DeepSpeed still asks them (else the adaptation is dead code), torch's inductor (which the real modules import and
# nothing else here does) never loads, and the step is torch's own AdamW step on the same weights.
_MUON = """
import json, os, sys, types
import torch
import deepspeed
from adaptations.deepspeed import MUON_MODULES, skip_muon_import, skip_shm_comm_build

reads = []


class Recording(types.ModuleType):
    def __getattribute__(self, name):
        if name in ("MuonWithAuxAdam", "muon_update", "adam_update"):
            reads.append(types.ModuleType.__getattribute__(self, "__name__").rsplit(".", 1)[1] + "." + name)
        return types.ModuleType.__getattribute__(self, name)


skip_shm_comm_build()
assert skip_muon_import() and skip_muon_import()  # idempotent
for name in MUON_MODULES:
    sys.modules[name].__class__ = Recording
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
twin = torch.nn.Linear(8, 8)
twin.load_state_dict(model.state_dict())
initial = model.weight.detach().clone()
config = {"train_batch_size": 1, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.ones(1, 8)).square().sum())
engine.step()
by_hand = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0)
twin(torch.ones(1, 8)).square().sum().backward()
by_hand.step()
refused = []  # what a Muon config or a use_muon parameter would reach: each fails by name
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import muon_update
for call in (lambda: MuonWithAuxAdam([]), lambda: muon_update(None, None)):
    try:
        call()
    except RuntimeError as e:
        refused.append("Muon optimizer is not loaded" in str(e))
print(json.dumps({"reads": sorted(set(reads)), "refused": refused,
                  "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "gap": (model.weight - twin.weight).abs().max().item(),
                  "moved": (model.weight - initial).abs().min().item()}))
"""


def test_deepspeed_still_reads_muon_for_an_adamw_engine_and_skip_muon_import_stands_in():
    seen = _child(_MUON)
    # upstream still: building and stepping an AdamW ZeRO-2 engine asks for Muon's class and its update
    assert "muon_optimizer.MuonWithAuxAdam" in seen["reads"] and "original_muon.muon_update" in seen["reads"]
    # adapted: the stand-ins answered, torch's inductor never loaded, the step is torch's AdamW step
    assert seen["inductor"] is False
    assert seen["moved"] > 5e-3 and seen["gap"] < 1e-6  # Adam's first step moves every weight by ~lr
    assert seen["refused"] == [True, True]  # building a Muon or updating a use_muon parameter: named
