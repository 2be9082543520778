"""runtime/placement.placement: where each stage runs, for each kind of config, by hand from the rules in its docstring
(replay, pool, parts, worker, group, process, first that applies); and that a config cannot send a reward-model stage to
a pool or a warm worker (it is refused when built, naming the field)."""

import json

import pytest

from ppoflow.config import ConfigError, load_config
from runtime.placement import placement

PPO = ("rollout", "rollout-part", "score", "update", "checkpoint", "eval")
RM = ("rm-prepare", "rm-unit", "rm-export")
POOLS = (
    "pipeline.stage_pools={rollout: ppo-rollout/a, score: ppo-score/b, update: ppo-update/c, "
    "checkpoint: ppo-checkpoint/d, eval: ppo-eval/e}"
)
WORKERS = "pipeline.stage_workers=[rollout, score, update, checkpoint]"

# (overrides, {stage: expected placement}); stages not named are "process".
CASES = [
    ([], {}),
    (["pipeline.stage_pools={score: ppo-score/ppo-score}"], {"score": "pool"}),
    (
        ["pipeline.stage_workers=[rollout, update]"],
        # eval samples with the rollout engine and a rollout part is a rollout: they go where rollout goes
        {"rollout": "worker", "rollout-part": "worker", "eval": "worker", "update": "worker"},
    ),
    (["pipeline.stage_workers=[score, checkpoint]"], {"score": "worker", "checkpoint": "worker"}),
    (["pipeline.rollout_parts=2"], {"rollout": "parts"}),  # the parts themselves in-process
    (
        ["pipeline.rollout_parts=2", "pipeline.stage_workers=[rollout]"],
        {"rollout": "parts", "rollout-part": "worker", "eval": "worker"},
    ),
    (  # a pool wins over a warm worker for the same stage; eval on its own pool while rollout is on workers
        ["pipeline.stage_pools={update: ppo-update/u, eval: ppo-eval/e}", "pipeline.stage_workers=[rollout, update]"],
        {"rollout": "worker", "rollout-part": "worker", "update": "pool", "eval": "pool"},
    ),
    (
        [POOLS, "pipeline.stage_workers=[score]"],
        {"rollout": "pool", "score": "pool", "update": "pool", "checkpoint": "pool", "eval": "pool"},
    ),
    # several update ranks with the update on no worker or pool: the torchrun group the training flow starts
    (["train.num_ranks=2"], {"update": "group", "checkpoint": "group"}),
    (["train.num_ranks=2", "pipeline.stage_workers=[checkpoint]"], {"update": "group", "checkpoint": "worker"}),
    # ... not when the user serves the update (a torchrun group of their own), nor on a pool (refused there by name)
    (
        ["train.num_ranks=2", "pipeline.stage_workers=[update, checkpoint]"],
        {"update": "worker", "checkpoint": "worker"},
    ),
    (["train.num_ranks=2", "pipeline.stage_pools={update: ppo-update/u}"], {"update": "pool"}),
]


@pytest.mark.parametrize("overrides, expected", CASES)
def test_each_config_places_each_stage(tmp_path, overrides, expected):
    cfg = load_config(None, overrides + [f"run.root={tmp_path}"])
    for stage in PPO + RM:
        assert placement(cfg, stage, 3) == expected.get(stage, "process"), (stage, overrides)


def test_reward_model_stages_run_in_process_whatever_the_ppo_stages_do(tmp_path):
    for extra in ([POOLS], [WORKERS], [WORKERS, "pipeline.rollout_parts=4"]):
        cfg = load_config(None, extra + [f"run.root={tmp_path}"])
        assert [placement(cfg, stage, unit) for stage in RM for unit in (0, 1, 7)] == ["process"] * 9


def test_a_fork_replays_the_rollout_of_its_replayed_iterations_only(tmp_path):
    """run.json's parent.replay = [3, 4] (flows/fork.py writes it): rollout 3 and 4 are replayed, whatever the
    pipeline settings say; other iterations and other stages are placed as usual."""
    fork = tmp_path / "fork"
    fork.mkdir()
    parent = {"run": "parent", "root": str(tmp_path), "iteration": 2, "run_id": "p", "replay": [3, 4]}
    (fork / "run.json").write_text(json.dumps({"run_id": "f", "results_epoch": 0, "parent": parent}))
    cfg = load_config(None, ["run.name=fork", f"run.root={tmp_path}", WORKERS, "pipeline.rollout_parts=2"])
    assert [placement(cfg, "rollout", i) for i in (2, 3, 4, 5)] == ["parts", "replay", "replay", "parts"]
    assert [placement(cfg, stage, 3) for stage in ("score", "update", "eval")] == ["worker"] * 3


@pytest.mark.parametrize(
    "override, field",
    [
        ("pipeline.stage_pools={rm-unit: rm-training/units}", "pipeline.stage_pools"),
        ("pipeline.stage_workers=[rm-unit]", "pipeline.stage_workers"),
    ],
)
def test_a_config_asking_for_a_reward_model_stage_elsewhere_is_refused(override, field):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    assert field in str(refused.value) and "rm-unit" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "overrides, stage, says, never",
    [
        # the group the flow started: only a retry of the flow run helps (a hand-started worker serves nothing of it)
        (
            ["train.num_ranks=2", "pipeline.retries=2"],
            "update",
            ["--max-restarts=3", "retry the flow run: it starts a new group"],
            "ppoflow worker",
        ),
        (["train.num_ranks=2"], "checkpoint", ["train.num_ranks=2", "new group"], "ppoflow worker"),
        # a worker the user runs: start it again
        (["pipeline.stage_workers=[update]"], "update", ["ppoflow worker --stage update"], "torchrun, train"),
        (
            ["train.num_ranks=2", "pipeline.stage_workers=[checkpoint]"],
            "checkpoint",
            ["ppoflow worker --stage checkpoint"],
            "new group",
        ),
        (["pipeline.stage_workers=[rollout]"], "eval", ["ppoflow worker --stage rollout"], "new group"),
    ],
)
def test_a_lost_worker_is_met_with_the_advice_for_whoever_started_it(tmp_path, overrides, stage, says, never):
    from runtime.stage_runs import _restart_advice

    cfg = load_config(None, overrides + [f"run.root={tmp_path}"])
    advice = _restart_advice(cfg, stage, 3)
    assert all(part in advice for part in says) and never not in advice, advice
