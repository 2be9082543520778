"""`ppoflow fork RUN --at N --name NEW [--root ROOT] [--set section.field=value ...]`: a run that starts from
RUN's committed checkpoint N with a changed config, its iterations 1..N shared with RUN by reference.

    fork_run(root, "base", 20, "base-kl0.1", ["algo.kl_coef=0.1"])  -> the fork's PPOFlowConfig

What the fork gets, and nothing is copied (storage/lineage.py):
- its config: RUN's saved config.yaml, `run.name=NEW`, `run.root=ROOT`, then the `--set` overrides (another
  run.root puts the fork under another root); saved as NEW's config.yaml;
- its run.json: a new run id (its stages compute their own results) and `parent: {run, root, iteration,
  run_id}`; `ppoflow runs show NEW` shows it, `ppoflow runs show RUN` lists the forks;
- its checkpoints/iter-N/ (and iter-(N-k).. with pipeline.max_staleness = k, which the first iterations sample
  with): references to RUN's, pinned in RUN's `_forks/NEW.json` so RUN's retention keeps them while NEW needs
  them. NEW's LATEST is N: training it runs N+1..run.iterations, as a resume of RUN would, under NEW's config.
  With nothing changed those iterations equal RUN's, bit for bit on CPU.
NEW's metrics.jsonl and iteration folders hold its own iterations only; RUN's rows 1..N stay RUN's.

A changed algo.kl_coef / kl_target / kl_horizon starts the fork's KL controller afresh from its settings; a changed
train.actor_lr / critic_lr / weight_decay replaces the parent's in the restored optimizer and scheduler, at the
schedule's position (engines/trainer/checkpoint.py); other state of checkpoint N (optimizer moments, scheduler step,
reward normaliser, RNG) carries on as in a resume.

Refused before anything is written, naming the field (ForkError): a change of what iterations 1..N were
trained with and the checkpoint depends on (FIXED_FIELDS; a changed algo.name that adds or drops the critic),
content of model.policy_path / model.critic_path / data.path other than RUN recorded at its first start, a fork
point RUN has not committed or whose checkpoint retention removed, a NEW that exists and is not this fork.
Forking again with the same arguments is a no-op (a fork interrupted half-way is completed).

`replay=M` (`--replay M`): the fork's iterations N+1..N+M train on RUN's committed rollout shards instead of sampling
again (runtime/replay.py), recorded as `parent.replay = [N+1, N+M]` in its run.json. Refused, naming the field: a
changed model, data or rollout setting (the saved rows would not be what the fork samples), dynamic sampling with a
changed reward (which groups it kept was the reward's), iterations RUN has not committed or has no rollout record
of, and iterations past N+1+pipeline.max_staleness without algo.tis_cap (RUN's policy sampled them, not the fork's).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from flows.run_inputs import fingerprint_inputs
from flows.run_root import absolute_root
from ppoflow.config import ConfigError, PPOFlowConfig, StorageConfig, apply_overrides, build_config
from stages.rescore import run_config
from storage import fs as fsutil
from storage import lineage
from storage.checkpoints import checkpoint_owner, latest_iteration, read_commit_marker
from storage.layout import RunLayout, _differences, layout_for
from storage.run_identity import new_run_record, read_run_record, write_run_record

# Settings a fork cannot change, and why: what iterations 1..N were trained with and checkpoint N depends on.
FIXED_FIELDS = {
    "run.seed": "it seeds the sampling and the prompt order of the iterations the fork shares",
    "model.policy_path": "checkpoint N holds that model's weights, shape and tokenizer",
    "model.critic_path": "checkpoint N's critic was built from it",
    "model.lora": "checkpoint N holds adapters of that shape",
    "data.path": "the shared iterations trained on its prompts, in their order",
    "data.prompt_key": "the shared iterations trained on its prompts, in their order",
    "data.reasoning_gym": "it generated the prompts of the shared iterations",
    "train.zero_stage": "checkpoint N's optimizer state is partitioned for its ZeRO stage",
}
# Inputs whose content must still be what RUN recorded (flows/run_inputs.py).
FIXED_INPUTS = ("model.policy_path", "model.critic_path", "data.path")


class ForkError(ConfigError):
    """A fork that cannot be made as asked; the message names the field or the checkpoint."""


def load_run_config(layout: RunLayout) -> PPOFlowConfig:
    """A run's saved config.yaml; FileNotFoundError naming it when the run does not exist."""
    if not layout.fs.exists(layout.config_path):
        raise FileNotFoundError(f"no run {layout.run_name!r} at {layout.url(layout.run_dir)} (no config.yaml)")
    return run_config(layout)


def fork_config(parent_cfg: PPOFlowConfig, name: str, overrides: Sequence[str] = ()) -> PPOFlowConfig:
    """RUN's config with run.name=NEW and the overrides; ForkError naming a field that cannot change."""
    data = apply_overrides(parent_cfg.model_dump(mode="json"), [f"run.name={name}", *overrides])
    cfg = build_config(data, f"fork {name!r} of run {parent_cfg.run.name!r}")
    check_fork_changes(parent_cfg, cfg)
    return cfg


def check_fork_changes(parent_cfg: PPOFlowConfig, cfg: PPOFlowConfig) -> None:
    old, new = parent_cfg.model_dump(mode="json"), cfg.model_dump(mode="json")
    for key in _differences(old, new):
        fixed = next((f for f in FIXED_FIELDS if key == f or key.startswith(f + ".")), None)
        if fixed is not None:
            raise ForkError(
                f"a fork of run {parent_cfg.run.name!r} cannot change {fixed} ({_value(old, fixed)!r} -> "
                f"{_value(new, fixed)!r}): {FIXED_FIELDS[fixed]}. Start a new run instead."
            )
    if parent_cfg.algo.uses_critic != cfg.algo.uses_critic:
        raise ForkError(
            f"a fork of run {parent_cfg.run.name!r} cannot change algo.name from {parent_cfg.algo.name!r} to "
            f"{cfg.algo.name!r}: checkpoint N {'holds' if parent_cfg.algo.uses_critic else 'has no'} critic, "
            f"and {cfg.algo.name!r} {'trains none' if parent_cfg.algo.uses_critic else 'needs one'}"
        )


def _value(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _check_inputs(parent: RunLayout, cfg: PPOFlowConfig) -> dict[str, Any]:
    """The fork's inputs' fingerprints; ForkError naming an input whose content is not what RUN recorded."""
    now = fingerprint_inputs(cfg)
    recorded = (read_run_record(parent) or {}).get("inputs", {})
    for field in FIXED_INPUTS:
        if field in now and field in recorded and now[field]["sha256"] != recorded[field]["sha256"]:
            raise ForkError(
                f"{field} ({now[field]['path']}) holds other content (sha256 {now[field]['sha256'][:12]}...) than "
                f"run {parent.run_name!r} recorded ({recorded[field]['sha256'][:12]}...): the fork would continue "
                f"checkpoint N on another model or other prompts"
            )
    return now


def _shared_checkpoints(parent: RunLayout, at: int, cfg: PPOFlowConfig) -> list[int]:
    """The parent's checkpoints the fork refers to: N, and with pipeline.max_staleness = k also N-k..N-1 (its
    first iterations sample with them). ForkError when N is not committed or one of them is gone."""
    latest = latest_iteration(parent)
    if at < 1 or latest is None or at > latest:
        raise ForkError(
            f"--at {at}: run {parent.run_name!r} has committed iterations up to {latest}, fork at 1..{latest}"
        )
    needed = list(range(max(1, at - cfg.pipeline.max_staleness), at + 1))
    for iteration in needed:
        if read_commit_marker(parent, iteration) is None:
            raise ForkError(
                f"checkpoint {iteration} of run {parent.run_name!r} is not there any more (retention keeps the last "
                f"run.keep_checkpoints={cfg.run.keep_checkpoints}): fork at an iteration whose checkpoint remains"
                + (" (pipeline.max_staleness needs the ones before it too)" if iteration < at else "")
            )
    return needed


# Sections whose change makes a parent's saved rollout something the fork would not have sampled.
REPLAY_SECTIONS = ("model", "data", "rollout")


def check_replay(parent: RunLayout, parent_cfg: PPOFlowConfig, cfg: PPOFlowConfig, at: int, replay: int) -> None:
    """ForkError naming the field or iteration when the fork cannot replay RUN's iterations at+1..at+replay."""
    old, new = parent_cfg.model_dump(mode="json"), cfg.model_dump(mode="json")
    for key in _differences({s: old[s] for s in REPLAY_SECTIONS}, {s: new[s] for s in REPLAY_SECTIONS}):
        raise ForkError(
            f"--replay {replay}: the fork changes {key} ({_value(old, key)!r} -> {_value(new, key)!r}); run "
            f"{parent.run_name!r}'s saved rollouts were sampled with its own model, data and rollout settings"
        )
    if cfg.rollout.dynamic_sampling.enabled and old["reward"] != new["reward"]:
        raise ForkError(
            f"--replay {replay}: rollout.dynamic_sampling.enabled is on and the reward changed: the groups run "
            f"{parent.run_name!r} kept were chosen by its reward"
        )
    last, latest = at + replay, latest_iteration(parent) or 0
    if replay < 0 or last > min(latest, cfg.run.iterations):
        raise ForkError(
            f"--replay {replay}: replays iterations {at + 1}..{last}; run {parent.run_name!r} committed up to "
            f"{latest} and the fork runs to run.iterations={cfg.run.iterations}"
        )
    on_policy = at + 1 + cfg.pipeline.max_staleness  # sampled with a checkpoint the fork shares
    if last > on_policy and cfg.algo.tis_cap is None:
        raise ForkError(
            f"--replay {replay}: iterations {on_policy + 1}..{last} of run {parent.run_name!r} were sampled by its "
            f"policy, not the fork's; set algo.tis_cap (importance weights against the rows' sampler log-probs)"
        )
    for iteration in range(at + 1, last + 1):
        owner = lineage.rollout_owner(parent, iteration)
        if lineage.stage_record(owner, iteration, "rollout") is None:
            raise ForkError(
                f"--replay {replay}: run {owner.run_name!r} has no rollout record of iteration {iteration} "
                f"({owner.url(owner.iteration_dir(iteration))}/_stages/rollout.json)"
            )


def fork_run(
    root: str,
    run: str,
    at: int,
    name: str,
    overrides: Sequence[str] = (),
    storage_cfg: Optional[StorageConfig] = None,
    replay: int = 0,
) -> PPOFlowConfig:
    """Make run `name` a fork of `run` (under `root`) at its committed iteration `at`, replaying `run`'s rollouts of
    the next `replay` iterations; returns the fork's config, ready for the training flow. See the module docstring
    for what is written and what is refused."""
    parent = RunLayout(root, run, storage_cfg)
    parent_cfg = load_run_config(parent)
    # The fork's root recorded absolute (flows/run_root.py): its config.yaml resumes it from any working folder.
    cfg = absolute_root(fork_config(parent_cfg, name, [f"run.root={root}", *overrides]))
    child = layout_for(cfg)
    if fsutil.join(child.root, name) == parent.run_dir:
        raise ForkError(f"--name {name!r}: a fork needs a name of its own")
    if cfg.run.iterations <= at:
        raise ForkError(
            f"run.iterations={cfg.run.iterations}: the fork starts after iteration {at}; add --set run.iterations=M "
            f"with M > {at}"
        )
    shared = _shared_checkpoints(parent, at, cfg)
    inputs = _check_inputs(parent, cfg)
    if replay:
        check_replay(parent, parent_cfg, cfg, at, replay)
    parent_entry = {
        "run": run,
        "root": lineage.root_url(parent),
        "iteration": at,
        "run_id": (read_run_record(parent) or {}).get("run_id"),
        **({"replay": [at + 1, at + replay]} if replay else {}),
    }
    record = read_run_record(child)
    if record is not None and lineage.parent_of(record) != parent_entry:
        raise ForkError(f"--name {name!r}: run {name!r} exists at {child.url(child.run_dir)} and is not this fork")
    child.write_config_once(cfg.to_yaml(), defaults=type(cfg)().model_dump(mode="json"))
    if record is None:
        write_run_record(child, {**new_run_record(inputs), "parent": parent_entry})
    elif (latest_iteration(child) or 0) > at:
        return cfg  # forked and trained on already
    _refer(parent, child, at, shared)
    return cfg


def _refer(parent: RunLayout, child: RunLayout, at: int, shared: list[int]) -> None:
    """Pin each shared checkpoint at its owner, check it is still committed there, then write the reference."""
    owners = {iteration: checkpoint_owner(parent, iteration) for iteration in shared}
    for owner in {o.run_dir: o for o in owners.values()}.values():
        lineage.pin(owner, child, at, [i for i, o in owners.items() if o.run_dir == owner.run_dir])
    for iteration, owner in owners.items():
        if read_commit_marker(owner, iteration) is None:  # removed between the check and the pin
            raise ForkError(f"checkpoint {iteration} of run {owner.run_name!r} was removed while forking")
        lineage.write_reference(child, owner, iteration)
    fsutil.write_json(
        child.fs,
        child.latest_path,
        {"iteration": at, "uri": parent.url(owners[at].checkpoint_dir(at)), "forked_from": parent.run_name},
    )
