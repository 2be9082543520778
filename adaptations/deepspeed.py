"""DeepSpeed, adapted (written against DeepSpeed 0.19.8 with torch 2.13, CPU accelerator included).

Each is called by engines/trainer/deepspeed_setup.py where its condition is known, not on import: whether the
shared-memory op is wanted depends on the world size and PPOFLOW_DS_SHM_COMM, the all-reduce on the engine built.
tests/unit/test_adaptations_deepspeed.py runs DeepSpeed's own code paths without them and fails once upstream
no longer does what they work around.
"""

from __future__ import annotations

import sys
import types
import warnings

SHM_COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME, the key DeepSpeed looks up
# DeepSpeed's comm layer calls these two (deepspeed/comm/torch.py) and torch 2.13 deprecated them for *_single.
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
# DeepSpeed's Muon modules, which it imports on an AdamW engine's paths only to ask "is this Muon?"
# (deepspeed/runtime/zero/utils.py, stage_1_and_2.py, stage3.py, bf16_optimizer.py).
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def skip_shm_comm_build() -> None:
    """Tell DeepSpeed its shared-memory all-reduce op is unavailable, so that setting up the process group does
    not compile it. Idempotent.

    Works around: DeepSpeed 0.19.8's TorchBackend builds that op (`build_shm_op`, deepspeed/comm/torch.py) for
    any world size on the CPU accelerator: ~150 s of JIT on 2 cores, then cached in ~/.cache/torch_extensions, so
    paid again by every fresh container and CI machine, and of no use to one rank. `build_shm_op` returns None
    when `deepspeed.ops.__compatible_ops__[SHM_COMM_OP]` is false; that dict is the one DeepSpeed keeps (it is
    computed once and cached in the module), so the edit persists. A DeepSpeed that stops reading it builds the op
    again: slower, not wrong. Several CPU ranks then use gloo's all-reduce (slower for large tensors than the op).
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def quiet_deprecated_collectives() -> None:
    """Ignore torch's FutureWarning about the two collectives DeepSpeed 0.19.8 calls (DEPRECATED_COLLECTIVES).

    Works around: it came back dozens of times per ZeRO-2/3 update on every rank, with nothing for a user to do,
    and in a rank's log (the update group's, whose end a failed start quotes) it pushed out the lines that explain a
    failure. A process-wide warnings filter for that one message; other FutureWarnings still show.
    """
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)


def skip_single_rank_allreduce(engine) -> bool:
    """Switch off a DeepSpeedEngine's gradient all-reduce where it has one rank at ZeRO stage 0. True when it did.

    Works around: DeepSpeed 0.19.8 still "all-reduces" the gradients over a world of one at stage 0, flattening and
    copying every gradient each step (31 ms per step on a 10M-parameter Llama, a no-op in effect).
    The engine's own `enable_backward_allreduce` flag (which DeepSpeed clears itself when it has no process group)
    turns it off. ZeRO stages 1-2 keep it: their reduction also fills the optimizer's flat partitions.
    """
    if engine.zero_optimization_stage() != 0 or engine.world_size != 1:
        return False
    engine.enable_backward_allreduce = False
    return True


class NoMuon:
    """Stands for DeepSpeed's `MuonWithAuxAdam` in a process that skipped importing it (`skip_muon_import`):
    no optimizer is an instance of it, and building one raises, naming why."""

    def __init__(self, *args, **kwargs):
        _no_muon()


def _no_muon(*args, **kwargs):
    raise RuntimeError(
        "DeepSpeed's Muon optimizer is not loaded in this process: ppoflow builds AdamW "
        "(engines/trainer/deepspeed_setup.py) and skipped its import (adaptations/deepspeed.py: skip_muon_import)"
    )


def skip_muon_import() -> bool:
    """Give DeepSpeed stand-ins for its two Muon modules (MUON_MODULES), so that an AdamW engine does not import
    the real ones. True when the stand-ins are in place (idempotent); False, changing nothing, when a real one is
    already imported (nothing left to save).

    Works around: DeepSpeed 0.19.8 imports both modules when it builds and steps any ZeRO engine, only to ask
    whether the optimizer is a `MuonWithAuxAdam` (`is_zero_supported_optimizer`, ZeRO-1/2's `average_tensor`) and
    to have `muon_update` at hand for parameters marked `use_muon`. `original_muon` decorates its kernels with
    `torch.compile`, which imports torch's inductor compiler: ~1 s of CPU in every process that builds an engine
    (each run, warm update worker and rank) for an optimizer ppoflow never uses (its DeepSpeed config always names
    AdamW). The stand-ins hold `NoMuon` and functions that raise: the checks answer "no" as the real class would,
    and a Muon optimizer or a `use_muon` parameter (neither of which ppoflow makes) fails by name. A DeepSpeed
    that no longer imports them on those paths leaves the stand-ins unread.
    """
    present = [sys.modules[name] for name in MUON_MODULES if name in sys.modules]
    if present:
        return all(getattr(module, "MuonWithAuxAdam", None) is NoMuon for module in present)
    for name in MUON_MODULES:
        stand_in = types.ModuleType(name, "ppoflow's stand-in: see adaptations/deepspeed.py, skip_muon_import")
        stand_in.MuonWithAuxAdam = NoMuon
        stand_in.muon_update = stand_in.adam_update = _no_muon
        sys.modules[name] = stand_in
    return True
