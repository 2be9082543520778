"""model.dtype=bfloat16, the default on a GPU (ppoflow.config.default_model_dtype): DeepSpeed's bf16 mode under
ZeRO-2 keeps float32 master weights, float32 gradient accumulation and float32 AdamW state, and one update's
losses and KL agree with the autocast recipe it replaces (float32 weights under bfloat16 autocast) and with
plain float32, within bfloat16's rounding. Runs on the CPU (bfloat16 is emulated there: slow, but exact in
what it computes); the speed is measured on a GPU by bench.update_mfu."""

from __future__ import annotations

import pytest
import torch

from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg

pytestmark = pytest.mark.slow

METRICS = ("loss/policy", "loss/value", "kl/mean", "policy/approx_kl", "policy/entropy", "values/mean")


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return _batch(tiny_model_dir, 1)


@pytest.fixture(scope="module")
def updates(tiny_model_dir, batch):
    """One update (2 epochs of one optimizer step of 2 micro-batches) per precision: metrics and the trainer."""
    recipes = {
        "fp32": {},
        "autocast": {"model.autocast_dtype": "bfloat16", "train.zero_stage": 0},
        "bf16": {"model.dtype": "bfloat16"},  # train.zero_stage unset: chosen for bfloat16 weights
    }
    out = {}
    for name, overrides in recipes.items():
        trainer = PPOTrainer(_cfg(tiny_model_dir, **overrides), str(tiny_model_dir))
        out[name] = (trainer.update(batch).metrics, trainer)
    return out


def test_bf16_weights_train_on_float32_masters(updates):
    metrics, trainer = updates["bf16"]
    assert trainer.cfg.train.zero_stage == 2
    assert {p.dtype for p in trainer.actor.module.parameters()} == {torch.bfloat16}
    optimizer = trainer.actor.optimizer
    assert optimizer.gradient_accumulation_dtype == torch.float32  # micro-batches summed in float32
    for master, bit16 in zip(optimizer.single_partition_of_fp32_groups, optimizer.parallel_partitioned_bit16_groups):
        assert master.dtype == torch.float32
        # The weights the model runs are the masters rounded to bfloat16 ...
        assert torch.equal(bit16[0], master.to(torch.bfloat16))
        # ... and the masters hold what bfloat16 cannot: they started as bfloat16 values (loaded from bfloat16
        # weights) and two float32 AdamW steps moved them off that grid. A bfloat16-only optimizer could not.
        assert bool((master.to(torch.bfloat16).float() != master).any())
    state = optimizer.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_one_update_agrees_with_autocast_within_bfloat16_rounding(updates):
    """Tolerance: 3% of the float32 value plus 5e-4. bfloat16 keeps 8 significant bits (relative rounding
    2^-9 ~ 2e-3 per operation); on the tiny model the log-probs of either bfloat16 recipe differ from float32 by
    up to ~1e-2, which moves these batch means by at most ~1% (approx_kl, a mean of squared log-ratio
    differences, the most) and the near-zero KL to the reference by ~1e-4. A wrong learning rate, a step lost
    or taken twice, or float32 weights silently left in place would move them far more, or not at all."""
    fp32, autocast, bf16 = (updates[name][0] for name in ("fp32", "autocast", "bf16"))
    for key in METRICS:
        bound = 0.03 * abs(fp32[key]) + 5e-4
        assert abs(bf16[key] - autocast[key]) <= bound, (key, bf16[key], autocast[key])
        assert abs(bf16[key] - fp32[key]) <= bound, (key, bf16[key], fp32[key])
    # bfloat16 really ran: the metrics are not float32's to the last bit
    assert any(bf16[key] != fp32[key] for key in METRICS)
