"""Saving and resuming the trainer: open formats only (safetensors + JSON, no pickle).

    out_dir/policy/   HF folder (save_pretrained, safetensors) + tokenizer: from_pretrained and vLLM load it;
                      with model.lora the merged weights, plus policy/adapter/ (peft's adapter folder)
    out_dir/critic/   ValueHeadModel.save: backbone + value_head.safetensors + critic.json (algo "ppo" only)
    out_dir/trainer/  actor_optimizer.{safetensors,json}, critic_optimizer.{...}, rng.{...} (with several ranks
                      one set per rank: actor_optimizer.rank<r>.*, ...; policy/, critic/, trainer.json by rank 0),
                      trainer.json (update count, KL controller, LR schedulers, engine step counters, the
                      running reward moments of reward.normalize=running, extra_state such as the data
                      cursor, and `optimizer_state`: false when the *_optimizer files were left out, as
                      train.optimizer_state_every leaves them out of all but every N-th checkpoint and the
                      run's last), config.json (the resolved run config)

Optimizer state: DeepSpeed's ZeRO optimizer `state_dict()` holds tensors (the torch AdamW state of the flat
fp32 partitions, and the fp32 master partitions) plus bookkeeping. Tensors and JSON values are saved; the
few Python objects it also holds (the loss-scaler object, the parameter-slice mapping, the ZeRO stage enum)
are derived from the model's structure and are taken from the freshly built engine at load time (with the
saved loss scale copied in). Loading restores the fp32 master weights too (`load_from_fp32_weights`), so a
resumed bf16 run continues from full-precision weights, not from the bf16 policy folder.
ZeRO-3 partitions the parameters themselves: the policy (and critic) folders are written from the state dict
DeepSpeed gathers one module at a time (`engine._zero3_consolidated_16bit_state_dict`, what its own
`save_16bit_model` uses; every rank must call it, rank 0 receives it). Its tensors have the parameters' dtype:
float32 on CPU (model.dtype float32, so the folder is full precision), bfloat16 on GPU runs; the fp32 master
partitions travel in the optimizer state either way. The stage-3 optimizer's state dict (the torch AdamW
state of the flat fp32 partitions, `fp32_flat_groups`, bookkeeping) is this rank's partition; loading it
restores the fp32 partitions and copies them into the (partitioned) parameters, so a resumed trainer continues
from the master weights. A world of one rank holds the whole partition.

Resuming on another number of ranks (engines/trainer/reshard.py): ZeRO 0 in float32 and ZeRO 1-2 carry their
optimizer state over (rank 0's whole state, or the saved partitions cut again for the new count); ZeRO-3 and
ZeRO 0 in bf16/fp16 are refused naming both counts.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from engines.hf_save import save_pretrained_hashed
from engines.trainer import reshard
from engines.trainer.direct_io import read_into_page_cache
from engines.trainer.lora import save_lora_policy
from engines.trainer.state import (
    DIRECT_MIN_BYTES,
    is_open_format,
    load_nested,
    rng_state,
    save_nested,
    set_rng_state,
)
from engines.weights_digest import policy_record, state_dict_record

_TRAINER_FILE = "trainer.json"


def _is_zero_optimizer(optimizer) -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, DeepSpeedZeroOptimizer)


def _is_zero3_optimizer(optimizer) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)


def gathered_state_dict(engine) -> Optional[dict[str, torch.Tensor]]:
    """The module's full state dict: its live tensors below ZeRO-3; under ZeRO-3 the parameters gathered from
    every rank's partition (copies on CPU), returned on rank 0 and None on the others. Every rank must call it."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict()


def _open_format_part(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer state dict that are tensors / JSON values (others come from the engine)."""
    kept = {key: value for key, value in state.items() if is_open_format(value)}
    scaler = state.get("loss_scaler")
    if scaler is not None and hasattr(scaler, "cur_scale"):
        kept["loss_scale"] = float(scaler.cur_scale)
    return kept


def save_optimizer(engine, folder: Path, stem: str) -> dict[str, str]:
    """Write the optimizer state as folder/stem.{safetensors,json}; returns {file name: sha256}."""
    if _is_zero3_optimizer(engine.optimizer):
        _zero_partition_padding(engine.optimizer)
    return save_nested(_open_format_part(engine.optimizer.state_dict()), folder, stem)


@torch.no_grad()
def _zero_partition_padding(optimizer) -> None:
    """Set the padding of the last rank's ZeRO-3 fp32 partitions to 0 (in place: no parameter reads it).

    ZeRO-3 cuts each parameter into world-size equal partitions; the last rank's is padded past the parameter's
    end, and DeepSpeed leaves those elements uninitialised (whatever the allocator returned). Saved as they are,
    two runs with the same weights wrote different optimizer files, so a checkpoint rebuilt after a failure had
    another identity (PolicyRef.weights_id hashes the files) than the one of the run that never failed.
    Layout of fp32 group i: the partitions of its parameters back to back (`fp16_partitioned_groups[i]`), each
    ending in `groups_padding[i][j]` padding elements (0 except on the last rank).
    """
    for flat, partitions, paddings in zip(
        optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups, optimizer.groups_padding
    ):
        offset = 0
        for partition, pad in zip(partitions, paddings):
            offset += partition.numel()
            if pad:
                flat.view(-1)[offset - pad : offset].zero_()


def load_optimizer(engine, folder: Path, stem: str, saved: Optional[dict] = None) -> None:
    """Load saved optimizer state (folder/stem, or `saved` as load_nested returns it) into a freshly built engine
    of the same model and config."""
    saved = load_nested(folder, stem) if saved is None else saved
    optimizer = engine.optimizer
    template = optimizer.state_dict()
    loss_scale = saved.pop("loss_scale", None)
    template.update(saved)
    if loss_scale is not None and hasattr(template.get("loss_scaler"), "cur_scale"):
        template["loss_scaler"].cur_scale = loss_scale
    # DeepSpeed takes every rank's state and reads its own rank's entry (the same partition layout: rigid)
    per_rank = [template] * engine.world_size
    if _is_zero_optimizer(optimizer):
        optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
    elif _is_zero3_optimizer(optimizer):  # restores the fp32 partitions and the parameters from them
        optimizer.load_state_dict(per_rank, load_optimizer_states=True)
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(template)
    else:
        raise NotImplementedError(
            f"resuming a {type(optimizer).__name__} optimizer is not supported "
            f"(train.zero_stage 0-3 use torch AdamW inside DeepSpeed)"
        )


def engine_counters(engine) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict(),
    }


def set_engine_counters(engine, state: dict[str, Any]) -> None:
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


def save_policy(trainer, policy_dir: str | Path) -> dict[str, str]:
    """Only the actor's HF folder (+ tokenizer): what a rollout engine needs to refresh its weights.

    Returns {file name: sha256} of the weight files, hashed as they were written (engines/hf_save.py).
    """
    state = gathered_state_dict(trainer.actor)  # every rank takes part in the gather; rank 0 writes
    if trainer.actor.global_rank != 0:
        return {}
    if trainer.cfg.model.lora is not None:  # merged weights + policy/adapter (engines/trainer/lora.py)
        digests = save_lora_policy(trainer.actor.module, state, policy_dir, trainer.cfg.model.lora)
    else:
        digests = save_pretrained_hashed(trainer.actor.module, policy_dir, state_dict=state)
    trainer.tokenizer.save_pretrained(Path(policy_dir))
    # files this large went past the page cache (state.write_safetensors), and a rollout engine loads them next:
    # from the cache, not the disk; smaller ones were written through it
    for weights in Path(policy_dir).glob("*.safetensors"):
        if weights.stat().st_size >= DIRECT_MIN_BYTES:
            read_into_page_cache(weights)
    return digests


def save_weights(trainer, out_dir: str | Path) -> dict[str, str]:
    """Write policy/ and critic/ (when there is one) under `out_dir`; {path relative to out_dir: sha256} of the
    weight files, hashed as they were written (the same files and hashes save_trainer's checkpoint holds)."""
    out = Path(out_dir)
    hashed = _under("policy", save_policy(trainer, out / "policy"))
    if trainer.critic is not None:
        critic_state = gathered_state_dict(trainer.critic)
        if trainer.actor.global_rank == 0:
            hashed.update(_under("critic", trainer.critic.module.save(out / "critic", trainer.tokenizer, critic_state)))
    return hashed


def save_trainer(
    trainer, out_dir: str, extra_state: Optional[dict] = None, optimizer_state: bool = True
) -> dict[str, str]:
    """Write policy/, critic/ (when there is one) and trainer/ under `out_dir` (see the module docstring);
    without `optimizer_state`, trainer/ holds no *_optimizer files (train.optimizer_state_every) and trainer.json
    says so.

    Returns {path relative to out_dir: sha256} of the files hashed while they were written (the weights,
    the optimizer and RNG state: all but a few small JSON files), so the checkpoint need not read them back.
    """
    out = Path(out_dir)
    rank, world = trainer.actor.global_rank, trainer.actor.world_size
    state_dir = out / "trainer"
    if optimizer_state and world == 1:
        # the optimizer state on a second thread while this one writes the weights: each file is hashed as it is
        # written, one core per file, and hashing is what a save spends its time on (hashlib lets go of the GIL)
        with ThreadPoolExecutor(1, thread_name_prefix="optimizer-state") as pool:
            optimizers = pool.submit(_save_optimizers, trainer, state_dir, rank, world)
            hashed = save_weights(trainer, out)
            hashes = optimizers.result()
    else:  # several ranks: the weights' gather is a collective, so each rank keeps to one order of calls
        hashed = save_weights(trainer, out)
        hashes = _save_optimizers(trainer, state_dir, rank, world) if optimizer_state else {}
    engines = {"actor": engine_counters(trainer.actor)}
    if trainer.critic is not None:
        engines["critic"] = engine_counters(trainer.critic)
    hashes.update(save_nested(rng_state(), state_dir, _rank_stem("rng", rank, world)))
    if world > 1:  # every rank's partition is on disk before rank 0 reports the checkpoint written
        import torch.distributed as dist

        dist.barrier()
        if rank != 0:
            return _under("trainer", hashes)
    extra = dict(trainer.extra_state, **(extra_state or {}))
    meta = {
        "update_count": trainer.update_count,
        "kl_controller": trainer.kl_controller.state_dict(),
        "engines": engines,
        "extra_state": extra,
        "world_size": world,
        "optimizer_state": optimizer_state,
        # what a rollout engine must hold to serve this policy (stages/attest.py); here, beside policy/, so a
        # policy folder swapped after the commit cannot bring its own record
        "policy_digest": _saved_policy_record(trainer, out / "policy"),
    }
    if trainer.reward_normalizer is not None:  # reward.normalize=running: the running moments (three floats)
        meta["reward_normalizer"] = trainer.reward_normalizer.state_dict()
    (state_dir / _TRAINER_FILE).write_text(json.dumps(meta, indent=1))
    (state_dir / "config.json").write_text(json.dumps(trainer.cfg.model_dump(mode="json"), indent=1))
    hashed.update(_under("trainer", hashes))
    return hashed


def _save_optimizers(trainer, state_dir: Path, rank: int, world: int) -> dict[str, str]:
    """The actor's (and the critic's) optimizer state under state_dir: {file name: sha256}."""
    hashes = save_optimizer(trainer.actor, state_dir, _rank_stem("actor_optimizer", rank, world))
    if trainer.critic is not None:
        hashes.update(save_optimizer(trainer.critic, state_dir, _rank_stem("critic_optimizer", rank, world)))
    return hashes


def _saved_policy_record(trainer, policy_dir: Path) -> dict:
    """The record of the policy folder just written (engines/weights_digest.py), taken from the actor's weights in
    memory, which are the tensors that folder's files were written from: the same value as reading the folder back
    (tests/unit/test_weights_digest.py), without reading 0.5 GB of SmolLM2 back from the disk (written past the page
    cache) through a memory map whose pages count in the process's resident set, at its peak, while it is read.
    The folder's own record where the written tensors are not the live ones: LoRA's merged weights, ZeRO-3's
    gathered copy (actor_weights is None there)."""
    autocast = trainer.cfg.model.autocast_dtype
    weights = None if trainer.cfg.model.lora is not None else trainer.actor_weights()
    if weights is None:
        return policy_record(policy_dir, autocast)
    return state_dict_record(weights, autocast)


def _load_role_optimizer(engine, folder: Path, stem: str, saved_world: int, mode: Optional[str]) -> None:
    """Load `engine`'s optimizer state saved by `saved_world` ranks (mode None: by as many as now run)."""
    rank, world = engine.global_rank, engine.world_size
    if mode is None:
        load_optimizer(engine, folder, _rank_stem(stem, rank, world))
    elif mode == reshard.REPLICATED:  # every saved rank's file holds the same whole state
        load_optimizer(engine, folder, _rank_stem(stem, 0, saved_world))
    else:
        saved = [load_nested(folder, _rank_stem(stem, r, saved_world)) for r in range(saved_world)]
        state = reshard.repartition(saved, engine.optimizer.state_dict(), rank, world)
        load_optimizer(engine, folder, stem, saved=state)


def _rank_stem(stem: str, rank: int, world: int) -> str:
    """One rank: `stem` (the files of a 1-rank run keep their names); several: `stem.rank<r>` per rank."""
    return stem if world == 1 else f"{stem}.rank{rank}"


def _under(folder: str, digests: dict[str, str]) -> dict[str, str]:
    """{name: sha256} of files in `folder` -> {"folder/name": sha256}, the checkpoint's relative paths."""
    return {f"{folder}/{name}": digest for name, digest in digests.items()}


_KL_SETTINGS = ("kl_coef", "kl_target", "kl_horizon")


def _same_kl_settings(folder: Path, cfg) -> bool:
    """False when the state was saved under other algo.kl_coef / kl_target / kl_horizon than `cfg` holds: a fork
    that changed them (flows/fork.py) starts its KL controller from its own settings, as a new run would, instead
    of the coefficient the checkpoint's controller reached. True for a resume (the same config) and for a state
    saved without its config."""
    saved = folder / "config.json"
    if not saved.is_file():
        return True
    algo = json.loads(saved.read_text()).get("algo", {})
    return all(algo.get(name) == getattr(cfg.algo, name) for name in _KL_SETTINGS)


def _saved_train_settings(folder: Path) -> dict[str, Any]:
    """The train section of the config the state was saved under ({} when it was saved without one)."""
    saved = folder / "config.json"
    return json.loads(saved.read_text()).get("train", {}) if saved.is_file() else {}


def retarget_lr(engine, lr: float, weight_decay: float) -> None:
    """Give a restored optimizer a fork's learning rate and weight decay (flows/fork.py), keeping the schedule's
    position: the optimizer and scheduler state of the checkpoint carry the parent's base rate, and LambdaLR sets
    lr = base_lr * factor(step) at each step, so both the base rates and the groups' current rates change."""
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"], group["weight_decay"] = lr, lr * factor(scheduler.last_epoch), weight_decay
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def load_trainer_state(trainer, state_dir: str, optimizer_state: bool = True) -> None:
    """Restore optimizer, scheduler, engine counters, KL controller, RNG and extra_state from `state_dir`.

    The weights come from the policy/critic folders the trainer was built from. The optimizer state is left as
    the trainer holds it (fresh, or rebuilt by replaying updates: stages/update_replay.py) without
    `optimizer_state`, or when `state_dir` was saved without one. Raises FileNotFoundError naming a missing file,
    ValueError when the checkpoint has a critic state but the trainer none (or back).
    """
    folder = Path(state_dir)
    meta_path = folder / _TRAINER_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"trainer state {meta_path} is missing")
    meta = json.loads(meta_path.read_text())
    has_critic_state = "critic" in meta["engines"]
    if has_critic_state != (trainer.critic is not None):
        raise ValueError(
            f"trainer state {folder} {'has' if has_critic_state else 'lacks'} a critic state but "
            f"algo.name={trainer.cfg.algo.name!r} {'does not use' if has_critic_state else 'uses'} a critic"
        )
    rank, world = trainer.actor.global_rank, trainer.actor.world_size
    saved_world = int(meta.get("world_size", 1))
    optimizer_state = optimizer_state and bool(meta.get("optimizer_state", True))
    mode = None if saved_world == world else reshard.other_count_mode(folder, trainer.cfg)
    if optimizer_state and saved_world != world and mode is None:
        raise ValueError(
            f"trainer state {folder} holds the optimizer partitions of {saved_world} rank(s) but this "
            f"trainer runs on {world}: resuming on another number of ranks is supported at train.zero_stage "
            f"1-2, and 0 with model.dtype=float32, when the stage is unchanged (start it on {saved_world} ranks)"
        )
    if optimizer_state:
        _load_role_optimizer(trainer.actor, folder, "actor_optimizer", saved_world, mode)
    set_engine_counters(trainer.actor, meta["engines"]["actor"])
    if trainer.critic is not None:
        if optimizer_state:
            _load_role_optimizer(trainer.critic, folder, "critic_optimizer", saved_world, mode)
        set_engine_counters(trainer.critic, meta["engines"]["critic"])
    if _same_kl_settings(folder, trainer.cfg):
        trainer.kl_controller.load_state_dict(meta["kl_controller"])
    saved, train = _saved_train_settings(folder), trainer.cfg.train
    # A fork with another learning rate or weight decay: the restored state holds the parent's (a resume: the same).
    for engine, name in ((trainer.actor, "actor_lr"), (trainer.critic, "critic_lr")):
        changed = (saved.get(name), saved.get("weight_decay")) != (getattr(train, name), train.weight_decay)
        if engine is not None and saved and changed:
            retarget_lr(engine, getattr(train, name), train.weight_decay)
    if trainer.reward_normalizer is not None and "reward_normalizer" in meta:
        trainer.reward_normalizer.load_state_dict(meta["reward_normalizer"])
    trainer.update_count = int(meta["update_count"])
    trainer.extra_state = dict(meta.get("extra_state") or {})
    set_rng_state(load_nested(folder, _rank_stem("rng", rank % saved_world, saved_world)))
