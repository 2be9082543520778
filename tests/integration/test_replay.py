"""Replay (runtime/replay.py): a fork at 2 that replays the parent's iteration 3 with a changed reward, in-process,
tiny model, CPU.

The parent `base` trains 1..3 with the toy digits reward. Two forks at 2 add a second reward source, `length`
(the response's length in characters, weight 0.5, a function file written here):
- `replayed` (--replay 1): its iteration 3 generates nothing (the rollout engine's generate is counted from outside:
  0 calls), runs only the `length` source (the digits function is not called, nor the reference model), and its
  scored rows hold the parent's digits scores and reference log-probs with `length` computed here by hand, the
  reward recombined as 1.0 * digits + 0.5 * length. Its folder holds no rollout shards, and its bytes for the part
  it shares with the parent (iterations 1..2, checkpoint 2, the rollout of 3) are < 1% of the parent's.
- `sampled` (no replay, score cache off): the same change, computed the ordinary way (generation, every source,
  the reference). Its scored rows and its checkpoint 3 are the replayed fork's, byte for byte: a replay is the
  fork it stands for, minus the work.
Then what a replay refuses, each naming the field, and `ppoflow rescore` of the same change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from tests.integration.pipeline_helpers import small_config
from tests.integration.test_fork import _digests

pytestmark = pytest.mark.slow

LENGTH_REWARD = """
def length_reward(queries, prompts, labels, **kwargs):
    return {"rewards": [float(len(q) - len(p)) for q, p in zip(queries, prompts)]}
"""


def _train(cfg) -> dict:
    from flows.training import ppo_training

    state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
    assert state.is_completed(), state
    return state.result()


def _bytes(*paths: Path) -> int:
    files = [p for path in paths for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _scored(run_dir: Path, iteration: int) -> pa.Table:
    from storage.fs import resolve
    from storage.shards import read_shards

    fs, path = resolve(str(run_dir / f"iter-{iteration:06d}" / "scored"))
    return read_shards(fs, path)


@pytest.fixture
def counters(monkeypatch):
    """Calls of the rollout engine's generate, of each reward function source (by name) and of the reference
    model's log-probs, counted by wrappers installed from outside."""
    from engines.rewards.function import FunctionRewardSource
    from engines.rollout.hf import HFRolloutEngine
    from engines.scoring.reference import ReferenceModel

    calls: dict[str, int] = {}

    def counting(cls, method, name_of):
        original = getattr(cls, method)

        def wrapper(self, *args, **kwargs):
            calls[name_of(self)] = calls.get(name_of(self), 0) + 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, wrapper)

    counting(HFRolloutEngine, "generate", lambda _: "generate")
    counting(FunctionRewardSource, "score", lambda source: f"reward:{source.name}")
    counting(ReferenceModel, "logprobs", lambda _: "reference")
    return calls


def test_a_replayed_fork_scores_only_the_changed_source_and_equals_the_sampled_one(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir, counters
):
    from engines import warm
    from flows.fork import ForkError, fork_run
    from flows.records import read_metrics
    from storage.layout import layout_for

    root = str(tmp_path / "root")
    base = small_config(root, "base", tiny_model_dir, digits_dataset_dir, iterations=3, run={"keep_checkpoints": 3})
    _train(base)
    (tmp_path / "length.py").write_text(LENGTH_REWARD)
    reward = (
        "reward.sources=[{kind: function, target: 'engines.toy.task:reward_func'}, "
        f"{{kind: function, target: '{tmp_path}/length.py:length_reward', name: length, weight: 0.5}}]"
    )
    replayed = fork_run(root, "base", 2, "replayed", [reward], replay=1)
    sampled = fork_run(root, "base", 2, "sampled", [reward, "score.cache=false"])
    base_dir, replay_dir = Path(layout_for(base).run_dir), Path(layout_for(replayed).run_dir)

    warm.invalidate()  # as a new process would
    counters.clear()
    _train(replayed)
    assert counters == {"reward:length": 1}  # no generate, no digits reward, no reference forward
    assert not (replay_dir / "iter-000003" / "rollout").exists()

    parent_rows, rows = _scored(base_dir, 3).to_pylist(), _scored(replay_dir, 3).to_pylist()
    assert len(rows) == len(parent_rows) == 16
    for parent, row in zip(parent_rows, rows):
        assert (row["prompt_ids"], row["response_ids"]) == (parent["prompt_ids"], parent["response_ids"])
        assert row["ref_logprobs"] == parent["ref_logprobs"]
        digits = json.loads(parent["reward_components"])["function"]
        length = float(len(row["response"]))  # the source's formula, by hand
        assert json.loads(row["reward_components"]) == {"function": digits, "length": length}
        assert row["reward"] == pa.array([min(10.0, 1.0 * digits + 0.5 * length)], pa.float32())[0].as_py()
    (metrics,) = read_metrics(layout_for(replayed))
    assert metrics["rollout/replayed"] == 1.0 and metrics["score/cache_misses"] == 16

    shared_in_parent = [base_dir / "iter-000001", base_dir / "iter-000002", base_dir / "checkpoints/iter-000002"]
    shared_in_parent.append(base_dir / "iter-000003" / "rollout")
    standing_for_them = [replay_dir / name for name in ("config.yaml", "run.json")]
    standing_for_them += [replay_dir / "checkpoints/iter-000002", replay_dir / "iter-000003/_stages/rollout.json"]
    assert sorted(p.name for p in replay_dir.glob("iter-*")) == ["iter-000003"]
    fork_bytes, parent_bytes = _bytes(*standing_for_them), _bytes(*shared_in_parent)
    print(f"replayed fork's bytes for the shared part: {fork_bytes}, the parent's: {parent_bytes}")
    assert fork_bytes < 0.01 * parent_bytes

    warm.invalidate()
    counters.clear()
    _train(sampled)
    assert counters["generate"] >= 1 and counters["reward:function"] >= 1 and counters["reference"] >= 1
    sampled_dir = Path(layout_for(sampled).run_dir)
    assert _scored(sampled_dir, 3).drop(["score_cache_hit"]) == _scored(replay_dir, 3).drop(["score_cache_hit"])
    assert _digests(sampled_dir / "checkpoints/iter-000003") == _digests(replay_dir / "checkpoints/iter-000003")

    with pytest.raises(ForkError, match=r"rollout\.temperature"):
        fork_run(root, "base", 2, "refused-1", ["rollout.temperature=0.5"], replay=1)
    with pytest.raises(ForkError, match=r"algo\.tis_cap"):  # iteration 3 was sampled by the parent's policy 2
        fork_run(root, "base", 1, "refused-2", [], replay=2)
    assert fork_run(root, "base", 1, "allowed", ["algo.tis_cap=2.0"], replay=2).run.name == "allowed"

    # `ppoflow rescore`: the same change as a fork at 2 that scores 3 and stops; the replayed fork's scores of these
    # very rows under this very scorer are in the score cache, so all 16 rows come from it.
    from cli.main import main

    assert main(["rescore", "base", "--iteration", "3", "--name", "rescored", "--root", root, "--set", reward]) == 0
    rescored_dir = Path(root) / "rescored"
    record = json.loads((rescored_dir / "iter-000003/_stages/score.json").read_text())
    assert (record["cache_hits"], record["computed"]) == (16, 0)
    assert _scored(rescored_dir, 3).drop(["score_cache_hit"]) == _scored(replay_dir, 3).drop(["score_cache_hit"])
    assert not (rescored_dir / "checkpoints/iter-000003").exists()
