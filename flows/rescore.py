"""`ppoflow rescore RUN --iteration K --name NEW --set reward...`: the fork of RUN at K-1 that replays K
(runtime/replay.py), its score stage only, and a line comparing the two rewards.

Its own module, above runtime/stage_runs.py: the rescore runs a stage, while run_stage (runtime/executors.py) asks
runtime/replay.py whether an iteration is replayed; in one module the two would import each other.
"""

from __future__ import annotations

from typing import Optional

from runtime.replay import replayed_rollout
from runtime.stage_runs import run_stage_in_process
from stages.manifests import ScoreManifest
from storage import lineage
from storage.layout import RunLayout, layout_for
from storage.run_identity import read_run_record

# What `rescore --set` may change: the reward and the score stage's settings (its help says "a reward field").
RESCORE_SECTIONS = ("reward.", "score.")


def rescore_fork(root: str, run: str, iteration: int, name: str, overrides=(), storage_cfg=None):
    """`ppoflow rescore RUN --iteration K --name NEW --set reward...`, first half: the fork NEW of RUN at K-1 that
    replays K and stops there (run.iterations=K unless the overrides say otherwise); returns its config. ForkError
    for K < 2 (a fork starts from a committed checkpoint) and as fork_run refuses."""
    from flows.fork import ForkError, fork_run

    if iteration < 2:
        raise ForkError(f"--iteration {iteration}: rescore forks at K-1 from its checkpoint; K must be >= 2")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not key.startswith(RESCORE_SECTIONS):
            raise ForkError(
                f"--set {item}: rescore changes how iteration {iteration}'s saved rollouts are scored (fields under "
                f"{', '.join(s.rstrip('.') for s in RESCORE_SECTIONS)}); to change {key}, fork instead: ppoflow fork "
                f"{run} --at {iteration - 1} --name {name} --replay 1 --set {item}"
            )
    return fork_run(root, run, iteration - 1, name, [f"run.iterations={iteration}", *overrides], storage_cfg, replay=1)


def rescore_iteration(cfg, iteration: int) -> ScoreManifest:
    """The second half: the fork's score stage of its replayed `iteration` (a task run, cached by its key), its
    scored shards written under the fork's folder. `ppoflow train` of the fork later trains on them (the score
    stage is then answered from its cache) and goes on."""
    return run_stage_in_process(cfg, "score", iteration, rollout=replayed_rollout(cfg, iteration))


def rescore_report(cfg, iteration: int):
    """Run rescore_iteration; returns what `ppoflow rescore` prints (rescore_summary)."""
    scored = rescore_iteration(cfg, iteration)
    layout = layout_for(cfg)
    parent = lineage.parent_of(read_run_record(layout)) or {}
    parent_layout = RunLayout(parent["root"], parent["run"], layout.storage_cfg)
    before = lineage.stage_record(parent_layout, iteration, "score") or {}
    return rescore_summary(cfg.run.name, parent["run"], iteration, before.get("reward_mean"), scored, layout)


def rescore_summary(name: str, parent: str, iteration: int, before: Optional[float], scored, layout):
    """A line comparing the parent's and the fork's reward/mean, then where the shards are and the command that
    trains on, each on a line of its own, printed whole at any width (ppoflow/tables.Lines: a command wrapped
    by the terminal's width could not be copied; print it with crop=False). A rich renderable."""
    from rich.console import Group
    from rich.text import Text

    from ppoflow.tables import Lines

    was = "-" if before is None else f"{before:.4f}"
    summary = (
        f"run {name}: iteration {iteration} of run {parent} rescored, reward/mean {was} -> {scored.reward_mean:.4f} "
        f"({scored.rows} rows, {scored.cache_hits} from the score cache)"
    )
    where = [("scored shards", scored.uri), ("train on", f"ppoflow train {layout.url(layout.config_path)}")]
    return Group(Text(summary), Lines(where))
