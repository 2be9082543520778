"""DeepSpeed in this process: distributed setup, the config dict built from TrainConfig, engine creation.

One process is rank 0 of world 1 unless a launcher set RANK/WORLD_SIZE; on CPU the CPU accelerator with the
gloo backend is used (DS_ACCELERATOR=cpu). DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op
when it starts (35 s on 2 cores, then cached in ~/.cache/torch_extensions; so paid again by every fresh
container and CI machine). With one rank there is nothing to reduce, so `setup_distributed` marks that op
unavailable (adaptations/deepspeed.py) and DeepSpeed falls back to plain torch.distributed. Several CPU ranks
use gloo's all-reduce too unless PPOFLOW_DS_SHM_COMM=1 (then the op is built: faster all-reduce of large
tensors between ranks of one node, at the price of that build on every fresh machine, which CI would pay in
every job).

Optimizer: AdamW with `torch_adam: true`, i.e. `torch.optim.AdamW(fused=True)` inside DeepSpeed's ZeRO
wrapper. Why: DeepSpeed's own fused CPU Adam needs a second JIT build (minutes on 2 cores); torch's fused
kernel exists for CPU and GPU (one kernel per step instead of ~8 ops per tensor: 22 -> ~8 ms per step on
the 10M-parameter peer-bench Llama). Its state is plain tensors.

Single rank, ZeRO stage 0: DeepSpeed would still "all-reduce" the gradients over the one rank, which
flattens and copies every gradient each step (31 ms per step on that Llama, a no-op in effect);
`make_engine` switches that reduction off (adaptations/deepspeed.py: the engine's own
`enable_backward_allreduce` flag, which DeepSpeed clears itself when it has no process group). ZeRO stages
1-2 keep it: their reduction also fills the optimizer's flat partitions.

Offload (train.offload): ZeRO's offload_optimizer / offload_param to "cpu". The optimizer stays torch's AdamW
(now on CPU tensors); DeepSpeed 0.19.8 accepts that because the optimizer comes from this config, not from
the caller. Its own DeepSpeedCPUAdam (faster on a GPU machine) would need the `cpu_adam` JIT build. On the
CPU accelerator DeepSpeed accepts both settings and trains; memory cannot move anywhere cheaper there.

LR schedule: linear warm-up over `warmup_steps` optimizer steps, then constant, linear decay to 0 or
cosine decay to 0 over the run's remaining steps (`total_steps`).
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import time
from typing import Any, Callable

import torch

from adaptations.deepspeed import (
    quiet_deprecated_collectives,
    skip_muon_import,
    skip_shm_comm_build,
    skip_single_rank_allreduce,
)
from engines.trainer.heap import retain_freed_memory
from ppoflow.config import default_zero_stage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> None:
    """Make this process a DeepSpeed rank (rank 0 of 1 when no launcher set the variables). Idempotent."""
    import torch.distributed as dist

    quiet_deprecated_collectives()  # adaptations/deepspeed.py

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not dist.is_initialized():
        if not torch.cuda.is_available() and (
            os.environ["WORLD_SIZE"] == "1" or os.environ.get("PPOFLOW_DS_SHM_COMM") != "1"
        ):
            skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        # One rank too: ZeRO 1-2's step all-reduces its overflow flag over the group even alone (a one-rank ZeRO-2
        # script aborted this way at exit once in CI, after printing its result: test_deepspeed_setup)
        atexit.register(_exit_after_collectives)


def _exit_after_collectives() -> None:
    """At the exit of a rank (one launched by torchrun, or the one rank of a plain process) that returns normally:
    leave the group, then let gloo's worker threads finish with the last collectives' tensors while the interpreter
    is still whole.

    Why: a gloo worker drops its reference to a finished collective (a ZeRO-3 all-gather's views of Python-owned
    tensors) after the caller's wait() has returned, and that drop takes the GIL. If the main thread runs on into
    interpreter finalization first, the worker's GIL request ends its thread inside ~AsyncAllgatherWork and the
    process aborts ("terminate called without an active exception", exit -6) after all its work succeeded (the
    backtrace of such a core). Seen in 5 of 26 runs of a 2-rank ZeRO-3 script that called destroy_process_group
    right after its last all-gather and exited (DeepSpeed's engines still reference the group, so its threads
    live on), 0 of 14 with this pause after that call. Sleeping releases the GIL; the workers need it for
    microseconds. Atexit callbacks run before finalization begins."""
    leave_process_group()
    time.sleep(_GIL_YIELD_S)


_GIL_YIELD_S = 0.05


def leave_process_group() -> None:
    """Destroy this process's default process group, if any, through DeepSpeed when it adopted it (DeepSpeed
    then also drops the groups it cached for that world, which a new world must not reuse). Idempotent."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


def join_process_group(
    store, rank: int, world: int, timeout_s: float, *, local_rank: int, master_addr: str, master_port: int
) -> None:
    """Make this process rank `rank` of a `world`-rank process group rendezvousing through `store` (the c10d
    TCPStore rank 0 of a torchrun group hosts at master_addr:master_port: engines/trainer/torchrun_group.py), then
    let DeepSpeed adopt that group.

    The environment variables a launcher would set are set too (DeepSpeed and `deepspeed_config` read them).
    gloo on CPU, NCCL on GPU (this rank's device: cuda:<local_rank>, its index on its node). `timeout_s` bounds
    every collective.
    """
    import datetime

    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if os.environ.get("PPOFLOW_DS_SHM_COMM") != "1":
            skip_shm_comm_build()
    import deepspeed

    dist.init_process_group(
        "nccl" if gpu else "gloo",
        store=dist.PrefixStore("process-group", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")  # adopts the group torch just made


def lr_multiplier(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    """step -> LR factor: (step + 1) / warmup during warm-up, then constant / linear / cosine to 0 at total."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"train.lr_schedule={schedule!r} is not one of constant, linear, cosine")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def world_size() -> int:
    """Ranks in this process's DeepSpeed world: the initialized process group's size (setup_distributed or
    join_process_group made it), 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def deepspeed_config(
    train_cfg, dtype: str, train_batch_size: int, lr: float, autocast_dtype: str | None = None, *, world: int
) -> dict[str, Any]:
    """The DeepSpeed config dict for one engine (actor or critic) trained by `world` data-parallel ranks.

    gradient accumulation = train_batch_size / (micro_batch_size * world). Raises ValueError naming
    train.micro_batch_size when it does not divide the per-rank train batch.

    `autocast_dtype` (model.autocast_dtype, e.g. "bfloat16"): the engine's forward runs under torch.autocast
    to it. DeepSpeed 0.19's engine.forward switches off an autocast the caller entered unless the config's
    `torch_autocast` section enables it (runtime/torch_autocast.py: autocast_if_enabled), so without this
    section the trainer's `with torch.autocast(...)` ran every actor/critic matmul in float32 (seen on an
    H200: fp32 sgemm kernels, 4% MFU). `lower_precision_safe_modules: []` keeps every gradient's
    reduction in its own dtype (float32), as without autocast; DeepSpeed's default would all-reduce
    nn.Linear gradients in the autocast dtype.
    """
    stage = default_zero_stage(dtype, train_cfg.offload) if train_cfg.zero_stage is None else train_cfg.zero_stage
    micro = min(train_cfg.micro_batch_size, train_batch_size // world)
    if micro < 1 or train_batch_size % (micro * world):
        raise ValueError(
            f"train.micro_batch_size={train_cfg.micro_batch_size} x world size {world} must divide "
            f"the train batch of {train_batch_size} samples"
        )
    return {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train_batch_size // (micro * world),
        "gradient_clipping": float(train_cfg.max_grad_norm or 0.0),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": train_cfg.weight_decay,
                "torch_adam": True,
                "fused": True,
            },
        },
        "zero_optimization": zero_config(stage, train_cfg.offload),
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        **_master_precision(dtype, stage),
        **(
            {"torch_autocast": {"enabled": True, "dtype": autocast_dtype, "lower_precision_safe_modules": []}}
            if autocast_dtype is not None
            else {}
        ),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _master_precision(dtype: str, stage: int) -> dict[str, Any]:
    """Float32 gradient accumulation for bfloat16 weights under ZeRO-2 (`data_types.grad_accum_dtype`).

    DeepSpeed's bf16 mode with ZeRO 1-2 keeps float32 master weights and AdamW state in the optimizer's flat
    partitions and copies the updated weights back into the bfloat16 parameters after each step. Under ZeRO-2
    the micro-batches' gradients are summed into the partition's gradient buffer, in the weights' dtype unless
    this section asks for float32: with bfloat16 (8 significant bits) a step of k micro-batches would round
    each of its k additions. Only for stage 2: DeepSpeed routes stage 1 with float32 accumulation to its
    BF16_Optimizer, whose state `engines/trainer/checkpoint.py` cannot resume, and stages 0 and 3 take
    their own paths (stage 0 refuses the mix)."""
    if dtype == "bfloat16" and stage == 2:
        return {"data_types": {"grad_accum_dtype": "fp32"}}
    return {}


def zero_config(stage: int, offload: str = "none") -> dict[str, Any]:
    """DeepSpeed's zero_optimization section: the stage, plus offload_optimizer / offload_param to CPU memory
    for train.offload "optimizer" / "optimizer_and_params" (the config validates the stage first)."""
    section: dict[str, Any] = {"stage": stage}
    if offload in ("optimizer", "optimizer_and_params"):
        section["offload_optimizer"] = {"device": "cpu"}
    if offload == "optimizer_and_params":
        section["offload_param"] = {"device": "cpu"}
    return section


def make_engine(model: torch.nn.Module, config: dict[str, Any], lr_factor: Callable[[int], float]):
    """deepspeed.initialize(model, AdamW, LambdaLR(lr_factor)) -> the DeepSpeedEngine."""
    import deepspeed

    setup_distributed()
    retain_freed_memory()  # a training process keeps what an update frees for the next one (heap.py)
    skip_muon_import()  # an AdamW engine: DeepSpeed's Muon module is a 1 s import to answer "not Muon"
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=params,
        config=config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor),
    )
    skip_single_rank_allreduce(engine)  # see the module docstring: reducing over one rank is a copy
    return engine


def sum_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    """{name: this rank's float} -> {name: the sum over all ranks} (an all-reduce; as is with one rank)."""
    if world == 1:
        return values
    import torch.distributed as dist

    total = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(total)
    return dict(zip(values, total.tolist()))
