"""DeepSpeed, adapted (written against DeepSpeed 0.19.8 with torch 2.13, CPU accelerator included).

Each is called by engines/trainer/deepspeed_setup.py where its condition is known, not on import: whether the
shared-memory op is wanted depends on the world size and PPOFLOW_DS_SHM_COMM, the all-reduce on the engine built.
tests/unit/test_adaptations_deepspeed.py runs DeepSpeed's own code paths without them and fails once upstream
no longer does what they work around.
"""

from __future__ import annotations

import warnings

SHM_COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME, the key DeepSpeed looks up
# DeepSpeed's comm layer calls these two (deepspeed/comm/torch.py) and torch 2.13 deprecated them for *_single.
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


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
