"""train.num_ranks: impossible rank counts are config errors naming the fields and the numbers, before any work;
a checkpoint saved by another number of ranks is refused naming both counts before any rank starts."""

import json

import pytest

from ppoflow.config import ConfigError, load_config
from stages.update_ranks import check_saved_ranks

# The default rollout batch: rollout.prompts_per_iteration 32 x rollout.n_samples 4 = 128 rows per step.


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train.num_ranks=0"], ("train.num_ranks", "greater than or equal to 1")),
        # 128 rows cannot be cut into 3 equal shares
        (["train.num_ranks=3"], ("train.num_ranks=3", "train batch of 128")),
        (["train.num_ranks=3", "train.train_batch_size=64"], ("train.num_ranks=3", "train batch of 64")),
        # 12 x 4 = 48 rows: micro-batches of 16 tile one rank's 48, not each of 2 ranks' 24
        (
            ["rollout.prompts_per_iteration=12", "train.num_ranks=2"],
            ("train.micro_batch_size=16", "train.num_ranks=2", "= 24"),
        ),
    ],
)
def test_rank_counts_the_batch_cannot_take_name_the_fields(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for name in named:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # one rank, the default
        ["train.num_ranks=2"],  # 64 rows each, micro-batches of 16
        ["train.num_ranks=4", "train.train_batch_size=32"],  # 8 each: micro-batches of min(16, 8)
        ["rollout.prompts_per_iteration=12", "train.num_ranks=2", "train.micro_batch_size=8"],
    ],
)
def test_rank_counts_that_tile_the_batch_are_accepted(overrides):
    load_config(None, overrides)


def test_a_checkpoint_of_another_rank_count_is_refused_naming_both(tmp_path):
    (tmp_path / "trainer").mkdir()
    meta = tmp_path / "trainer" / "trainer.json"
    meta.write_text(json.dumps({"update_count": 1, "world_size": 2}))
    check_saved_ranks(str(tmp_path), 2)
    check_saved_ranks(None, 4)  # the initial model: nothing saved, any count
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) but train.num_ranks=4.*set train.num_ranks=2"):
        check_saved_ranks(str(tmp_path), 4)
    meta.write_text(json.dumps({"update_count": 1}))  # written before world_size was recorded: one rank
    with pytest.raises(ValueError, match=r"saved by 1 rank\(s\) but train.num_ranks=2"):
        check_saved_ranks(str(tmp_path), 2)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train.hostfile=/tmp/hosts"], "train.hostfile"),
        (["train.master_port=29500", "train.master_addr=node-a"], "train.master_addr, train.master_port"),
        (["train.rank_timeout_s=60"], "train.rank_timeout_s"),
        (["train.rank_agent_join_s=30", "train.rank_heartbeat_lost_s=10"], "train.rank_agent_join_s"),
    ],
)
def test_the_fields_of_the_removed_rank_group_are_refused_naming_what_replaces_them(overrides, named):
    """ppoflow's own multi-node rank group (hostfile, rank agents, heartbeats) is gone: a config that still sets one
    of its fields is refused by name, pointing at torchrun, not silently ignored."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert named in str(err.value) and "removed" in str(err.value)
    assert "torchrun --nnodes=N --rdzv-backend=c10d" in str(err.value)


def test_the_bare_engine_loop_refuses_several_ranks_by_name(tmp_path):
    """stages/loop.py trains in its own process on one rank: train.num_ranks=2 is a ConfigError naming the field
    and the way to several ranks, before any model is loaded (the model path does not even exist)."""
    from stages.loop import EngineLoop

    cfg = load_config(None, ["train.num_ranks=2", f"model.policy_path={tmp_path / 'no-model'}"])
    with pytest.raises(ConfigError, match=r"train.num_ranks=2: the in-memory loop trains on one rank.*ppoflow train"):
        EngineLoop(cfg)
