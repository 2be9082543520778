"""`ppoflow rescore RUN --iteration K --name NEW --set reward...`: the fork of RUN at K-1 that replays K
(flows/replay.py), its score stage only, and a line comparing the two rewards.

Its own module, above flows/stage_runs.py: the rescore runs a stage, while run_stage (flows/stage_runs.py) asks
flows/replay.py whether an iteration is replayed; in one module the two would import each other.
"""

from __future__ import annotations

from flows.replay import replayed_rollout
from flows.stage_runs import run_stage_in_process
from stages.manifests import ScoreManifest
from storage import lineage
from storage.layout import RunLayout, layout_for
from storage.run_identity import read_run_record


def rescore_fork(root: str, run: str, iteration: int, name: str, overrides=(), storage_cfg=None):
    """`ppoflow rescore RUN --iteration K --name NEW --set reward...`, first half: the fork NEW of RUN at K-1 that
    replays K and stops there (run.iterations=K unless the overrides say otherwise); returns its config. ForkError
    for K < 2 (a fork starts from a committed checkpoint) and as fork_run refuses."""
    from flows.fork import ForkError, fork_run

    if iteration < 2:
        raise ForkError(f"--iteration {iteration}: rescore forks at K-1 from its checkpoint; K must be >= 2")
    return fork_run(root, run, iteration - 1, name, [f"run.iterations={iteration}", *overrides], storage_cfg, replay=1)


def rescore_iteration(cfg, iteration: int) -> ScoreManifest:
    """The second half: the fork's score stage of its replayed `iteration` (a task run, cached by its key), its
    scored shards written under the fork's folder. `ppoflow train` of the fork later trains on them (the score
    stage is then answered from its cache) and goes on."""
    return run_stage_in_process(cfg, "score", iteration, rollout=replayed_rollout(cfg, iteration))


def rescore_report(cfg, iteration: int) -> str:
    """Run rescore_iteration; one line: the parent's and the fork's reward/mean, where the shards are, what next."""
    scored = rescore_iteration(cfg, iteration)
    layout = layout_for(cfg)
    parent = lineage.parent_of(read_run_record(layout)) or {}
    parent_layout = RunLayout(parent["root"], parent["run"], layout.storage_cfg)
    before = lineage.stage_record(parent_layout, iteration, "score") or {}
    return (
        f"run {cfg.run.name}: iteration {iteration} of run {parent['run']} rescored, reward/mean "
        f"{before.get('reward_mean', float('nan')):.4f} -> {scored.reward_mean:.4f} ({scored.rows} rows, "
        f"{scored.cache_hits} from the score cache); scored shards: {scored.uri}; train on from them: "
        f"ppoflow train {layout.url(layout.config_path)}"
    )
