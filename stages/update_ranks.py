"""The update stage on a torchrun group of train.num_ranks data-parallel ranks kept between iterations.

The group is the warm update worker (engines/trainer/torchrun_group.py): `torchrun --nproc-per-node=N --no-python
ppoflow worker --stage update --stage checkpoint`, started by the user (pipeline.stage_workers) or by `ppoflow train`
itself (runtime/update_group.py). Rank 0 runs the stage's task; ranks 1..N-1 run `follow` below. Per iteration rank 0
sends them small JSON commands, each followed by the same call on every rank:

    build   {config, policy, checkpoint_dir}   build_trainer(cfg, policy, checkpoint_dir)  (only when the ranks'
                                               trainers do not hold the policy: a new group, another run, a retry)
    update  {iteration, scored}                read this rank's rows of the scored shards `scored` (the stage's
                                               ScoreManifest) names, checked against its hash; train on them
    save    {dir, extra_state}                 trainer.save(dir): rank 0 writes policy/, critic/, trainer.json;
                                               every rank its optimizer partition and RNG state

Each rank reads its rows of the scored shards itself (nothing but the command travels from rank 0), at the handed
manifest's uri after checking that the shards there have its content hash (stages/handed.py; rank 0 checks before
any command is sent, every rank again as it reads): of the iteration's B rows in manifest order, rank r takes rows
[r*B/N, (r+1)*B/N) (`read_rank_rows`: only the parts holding some of them are fetched, each verified whole). It
runs the old log-prob / value forward on them only; the trainer then all-gathers every rank's rows with those
outputs, computes group baselines and advantage whitening over the whole batch on every rank, and each rank trains
on its share of every optimizer step with the whole step's denominators (engines/trainer/rank_rows.py,
ppo_trainer.py), so N ranks take the 1-rank update. Rank 0 also reads every row: it writes the iteration's
experience shards, which carry all the scored columns.

Failure: an exception during the commands breaks the group (TorchrunGroup.failed names a follower's own error);
rank 0 then ends its process and torchrun restarts every rank (--max-restarts). The retried stage goes to the
restarted group, whose trainers are built from the committed checkpoint the stage starts from, so it equals a run
that never failed. A process that no torchrun started refuses a run with train.num_ranks > 1 (ConfigError naming the
command to start instead).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from engines import warm
from engines.trainer import torchrun_group
from engines.trainer.ppo_trainer import PPOTrainer, UpdateResult
from engines.trainer.rank_rows import rank_rows
from engines.trainer.reshard import other_count_mode
from ppoflow.config import ConfigError
from stages.curriculum_state import next_state, stage_state
from stages.handed import open_handed
from stages.held import trainer_key
from stages.manifests import PolicyRef, ScoreManifest, UpdateManifest
from stages.mismatch_gate import gate_mismatch
from stages.policy import checkpoint_weights_id, local_checkpoint_dir
from stages.tables import experience_batch, experience_table, write_stage_table
from stages.update_trainer import build_trainer, staleness, update_manifest
from storage.checkpoints import save_checkpoint_files
from storage.layout import layout_for
from storage.schema import schema_for
from storage.scratch import checkpoint_scratch
from storage.shards import Manifest, read_part, read_shards, require_manifest


def check_saved_ranks(ckpt: Optional[str], ranks: int, cfg=None) -> None:
    """ValueError naming both counts when the checkpoint at `ckpt` was saved by another number of ranks and
    cannot resume on `ranks` under the run config `cfg` (engines/trainer/reshard.py: ZeRO 1-2, and 0 in float32,
    can; without `cfg`, no other count is allowed). Checked before any rank is told to build (and by preflight).
    """
    meta = Path(ckpt, "trainer", "trainer.json") if ckpt is not None else None
    if meta is None or not meta.is_file():
        return
    saved = int(json.loads(meta.read_text()).get("world_size", 1))
    if saved != ranks and (cfg is None or other_count_mode(meta.parent, cfg) is None):
        raise ValueError(
            f"checkpoint {ckpt} was saved by {saved} rank(s) but train.num_ranks={ranks}: resuming on another "
            f"number of ranks is supported at train.zero_stage 1-2, and 0 with model.dtype=float32, when the "
            f"stage is unchanged (ZeRO-3 partitions are not re-cut); set train.num_ranks={saved}"
        )


def check_sees_storage(cfg, checkpoint_dir: Optional[str]) -> None:
    """FileNotFoundError when this rank's machine cannot see the run folder or the checkpoint folder rank 0 named.

    On one node they are the same disk. A torchrun group over several nodes needs the run's storage mounted at the
    same path on every node; a node that does not would otherwise fail later on some shard with a bare "no such
    file".
    """
    import socket

    layout = layout_for(cfg)
    missing = [] if layout.fs.exists(layout.run_dir) else [layout.run_dir]
    if checkpoint_dir is not None and not os.path.isdir(checkpoint_dir):
        missing.append(checkpoint_dir)
    if missing:
        raise FileNotFoundError(
            f"{socket.gethostname()} cannot see {' or '.join(missing)}: every node of the torchrun update group "
            f"must mount the run's storage at the same path as rank 0's node"
        )


def read_rank_rows(
    fs, stage_dir: str, rank: int, world: int, expected_rows: int, manifest: Optional[Manifest] = None
) -> pa.Table:
    """Rank `rank`'s rows [r*B/N, (r+1)*B/N) of the committed shards in `stage_dir` (B rows in manifest order).

    manifest: the folder's shard manifest as the caller read and checked it (stages/handed.open_handed), else read
    here. Only the parts that hold some of those rows are read, each verified whole (size, sha256, schema) against it
    as read_shards verifies them. Raises ValueError when the manifest lists another number of rows than
    `expected_rows` (what rank 0 read), plus read_part's errors naming a part.
    """
    manifest = manifest or require_manifest(fs, stage_dir)
    if manifest.rows != expected_rows:
        raise ValueError(f"scored shards {manifest.uri} hold {manifest.rows} rows, rank 0 expects {expected_rows}")
    start, stop = rank_rows(manifest.rows, rank, world)
    pieces, first = [], 0  # first: the row number of the part's first row
    for part in manifest.parts:
        lo, hi = max(start, first), min(stop, first + part.rows)
        if lo < hi:
            pieces.append(read_part(fs, stage_dir, part, manifest.kind).slice(lo - first, hi - lo))
        first += part.rows
    return pa.concat_tables(pieces) if pieces else schema_for(manifest.kind).empty_table()


def train_on_rows(trainer: PPOTrainer, rows: pa.Table) -> UpdateResult:
    """One PPO update where `rows` are this rank's rows of the scored shards (the trainer gathers the others');
    the result holds all rows' per-token lists."""
    return trainer.update_rows(experience_batch(rows, trainer.tokenizer.pad_token_id or 0))


def run_update_on_ranks(cfg, iteration: int, policy: PolicyRef, scored: ScoreManifest) -> UpdateManifest:
    """run_update on the torchrun group this process is rank 0 of (see the module docstring).

    Raises ConfigError when no torchrun started this process (`torchrun_group_for`); ValueError when the group's size
    is not train.num_ranks, RuntimeError when an earlier command broke it (TorchrunGroup.require); HandedShardsError
    before any rank is told, when the scored shards are not the handed ones; the group's error (TorchrunGroup.failed)
    when a command fails on any rank."""
    group = torchrun_group_for(cfg)
    started = time.perf_counter()
    layout = layout_for(cfg)
    here = layout.url(layout.stage_dir(iteration, "scored"))  # where a moved run keeps it (handed.py)
    scored_fs, scored_dir, found = open_handed(
        cfg.storage, scored, "update", iteration, here
    )  # before any rank is told
    ckpt = local_checkpoint_dir(cfg, policy)  # fetched once on this machine; the ranks build from it
    check_saved_ranks(ckpt, cfg.train.num_ranks, cfg)
    try:
        trainer = warm.take(trainer_key(policy.weights_id))
        if trainer is None or group.holds != policy.weights_id:
            trainer = None
            gc.collect()  # the old trainer's memory goes before the new one is built, on every rank
            command = {"config": cfg.model_dump(mode="json"), "policy": policy.model_dump(mode="json")}
            group.send({"op": "build", "checkpoint_dir": ckpt, **command})
            trainer = build_trainer(cfg, policy, ckpt)
            warm.count_build(warm.Role.TRAINER.value)
        group.holds = None  # from here on the ranks' weights move past `policy`
        group.send({"op": "update", "iteration": iteration, "scored": scored.model_dump(mode="json")})
        table = read_shards(scored_fs, scored_dir, manifest=found)  # all rows (the experience shards), as checked
        start, stop = rank_rows(table.num_rows, 0, group.world)
        result = train_on_rows(trainer, table.slice(start, stop - start))
        exp_manifest = write_stage_table(cfg, layout, iteration, "experience", experience_table(table, result))
        curriculum, curriculum_metrics = next_state(cfg, policy, table)  # data.reasoning_gym.curriculum
        extra_state = {"iteration": iteration, "data_cursor": {"next_iteration": iteration + 1}}
        with checkpoint_scratch(layout) as tmp:
            group.send({"op": "save", "dir": tmp, "extra_state": extra_state})
            hashed = trainer.save(tmp, extra_state=extra_state)  # the ranks' files are on disk when it returns
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                f.write(cfg.to_yaml())
            stage_state(tmp, curriculum)
            staged = save_checkpoint_files(layout, iteration, tmp, move=True, known_sha256=hashed)
    except BaseException as exc:
        error = group.failed(exc)  # the group is broken: rank 0 ends after the stage, torchrun restarts it
        if error is exc:
            raise
        raise error from exc
    weights_id = checkpoint_weights_id(staged["files"])
    group.holds = weights_id
    warm.put(trainer_key(weights_id), trainer)
    metrics = {**result.metrics, **curriculum_metrics}
    metrics["ranks/world_size"] = float(group.world)
    metrics["async/staleness"] = staleness(policy, table)
    metrics = gate_mismatch(cfg, iteration, policy, table, metrics)  # after the group's work: it is not broken
    return update_manifest(layout, iteration, weights_id, exp_manifest.content_hash, metrics, started)


def torchrun_group_for(cfg) -> torchrun_group.TorchrunGroup:
    """The torchrun group this process is rank 0 of, checked to have train.num_ranks ranks.

    ConfigError, naming train.num_ranks and the command to start, when torchrun did not start this process: a plain
    `ppoflow worker --stage update`, a pool's update flow, a direct call. The ranks are never started from here."""
    group = torchrun_group.current()
    if group is None:
        ranks = cfg.train.num_ranks
        raise ConfigError(
            f"train.num_ranks={ranks}: the update runs on a torchrun group of {ranks} ranks, and this process is not "
            f"rank 0 of one (a plain `ppoflow worker --stage update`, a pool's update flow, or a direct call). Serve "
            f"the run's update with `torchrun --nproc-per-node={ranks} --no-python ppoflow worker --stage update "
            f"--stage checkpoint` (--nnodes and --rdzv-endpoint for several machines) and pipeline.stage_workers: "
            f"[update, checkpoint], or leave update and checkpoint off workers and pools: `ppoflow train` then starts "
            f"that group itself"
        )
    group.require(cfg.train.num_ranks)
    return group


class _Rank:
    """A rank's state between commands: the run config and the trainer (built by `build`)."""

    def __init__(self):
        self.cfg = None
        self.trainer = None

    def __call__(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "build":
            from ppoflow.config import build_config

            self.trainer = None
            gc.collect()
            self.cfg = build_config(command["config"], origin="the update group's build command")
            check_sees_storage(self.cfg, command["checkpoint_dir"])
            policy = PolicyRef.model_validate(command["policy"])
            self.trainer = build_trainer(self.cfg, policy, command["checkpoint_dir"])
        elif op == "update":
            scored = ScoreManifest.model_validate(command["scored"])
            layout = layout_for(self.cfg)
            here = layout.url(layout.stage_dir(command["iteration"], "scored"))
            fs, stage_dir, found = open_handed(self.cfg.storage, scored, "update", command["iteration"], here)
            rank, world = self.trainer.actor.global_rank, self.trainer.actor.world_size
            train_on_rows(self.trainer, read_rank_rows(fs, stage_dir, rank, world, scored.rows, found))
        elif op == "save":
            self.trainer.save(command["dir"], extra_state=command["extra_state"])
        else:
            raise ValueError(f"unknown update-group command {op!r} (build, update, save, stop)")


def follow(group: torchrun_group.TorchrunGroup) -> None:
    """Ranks 1..N-1 of a torchrun group (runtime/workers.py): rank 0's commands until it stops them (exits)."""
    group.follow(_Rank())
