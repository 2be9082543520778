"""The eval stage's schedule, sampling settings and cache key; the config's refusals for eval and dynamic sampling."""

import pytest

from ppoflow.config import ConfigError, build_config
from stages.evaluate import eval_due, eval_sampling, eval_sampling_seed
from stages.manifests import PolicyRef
from tasks.cache_keys import stage_cache_key


def _cfg(**sections):
    data = {"run": {"name": "t", "iterations": 7}, "rollout": {"n_samples": 2, "top_k": 5, "max_new_tokens": 9}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return build_config(data)


def test_eval_due_every_k_and_at_the_last_iteration():
    cfg = _cfg(eval={"data_path": "held.jsonl", "every": 3})
    assert [i for i in range(1, 8) if eval_due(cfg, i)] == [3, 6, 7]  # multiples of 3, and the last (7)
    assert not any(eval_due(_cfg(), i) for i in range(1, 8))  # no data_path: no eval


def test_greedy_is_top_k_1_and_the_rest_comes_from_rollout():
    greedy = eval_sampling(_cfg(eval={"data_path": "h", "n_samples": 3}))
    assert (greedy.n, greedy.top_k, greedy.temperature, greedy.max_new_tokens) == (3, 1, 1.0, 9)
    warm = eval_sampling(_cfg(eval={"data_path": "h", "temperature": 0.7, "max_new_tokens": 4}))
    assert (warm.top_k, warm.temperature, warm.max_new_tokens) == (5, 0.7, 4)
    assert eval_sampling_seed(0, 3) == eval_sampling_seed(0, 3) != eval_sampling_seed(0, 4)


def test_cache_keys():
    ref = PolicyRef(version=1, checkpoint_iteration=1, uri="u", weights_id="ckpt-a")
    base = _cfg(eval={"data_path": "h"})
    key = stage_cache_key(base, "eval", 1, {"policy": ref})
    assert key.startswith("t-iter-000001-eval-")
    assert key != stage_cache_key(_cfg(eval={"data_path": "h", "n_samples": 2}), "eval", 1, {"policy": ref})
    other = ref.model_copy(update={"weights_id": "ckpt-b"})
    assert key != stage_cache_key(base, "eval", 1, {"policy": other})
    # the rollout's key takes the reward section only when dynamic sampling decides which groups it keeps
    reward = {"clip": 5.0}
    assert stage_cache_key(base, "rollout", 1, {"policy": ref}) == stage_cache_key(
        _cfg(eval={"data_path": "h"}, reward=reward), "rollout", 1, {"policy": ref}
    )
    dynamic = {"dynamic_sampling": {"enabled": True}}
    assert stage_cache_key(_cfg(rollout=dynamic), "rollout", 1, {"policy": ref}) != stage_cache_key(
        _cfg(rollout=dynamic, reward=reward), "rollout", 1, {"policy": ref}
    )


@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"rollout": {"n_samples": 1, "dynamic_sampling": {"enabled": True}}, "algo": {"name": "ppo"}},
            "n_samples >= 2",
        ),
        (
            {
                "rollout": {"n_samples": 4, "prompts_per_iteration": 4, "dynamic_sampling": {"enabled": True}},
                "train": {"train_batch_size": 2, "micro_batch_size": 2},
            },
            "multiple of rollout.n_samples=4",
        ),
        (
            {"eval": {"data_path": "h"}, "pipeline": {"stage_pools": {"rollout": "ppo-rollout/ppo-rollout"}}},
            "pipeline.stage_pools.eval",
        ),
        ({"eval": {"every": 0}}, "eval.every"),
    ],
)
def test_refusals_name_the_field(sections, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**sections)
