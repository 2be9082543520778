"""Scaling the update on real DeepSpeed (CPU accelerator, gloo, one rank): ZeRO-3 checkpoints, offload,
gradient checkpointing, LoRA."""

from __future__ import annotations

import pytest
import torch

from engines.trainer import ppo_trainer
from engines.trainer.checkpoint import gathered_state_dict
from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    return _batch(tiny_model_dir, 1), _batch(tiny_model_dir, 2)


@pytest.fixture
def partition_every_parameter(monkeypatch):
    """ZeRO-3 keeps parameters under 100k elements whole on every rank (stage3_param_persistence_threshold):
    the tiny Llama's are all smaller, so without this nothing would be partitioned and gathered."""
    build = ppo_trainer.deepspeed_config

    def config(*args, **kwargs):
        cfg = build(*args, **kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return cfg

    monkeypatch.setattr(ppo_trainer, "deepspeed_config", config)


def _full(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in gathered_state_dict(engine).items()}


def test_zero3_saves_a_loadable_policy_and_resumes_like_uninterrupted(
    tiny_model_dir, batches, tmp_path, partition_every_parameter
):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny_model_dir, **{"train.zero_stage": 3})
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    # Really partitioned: outside a forward the module's parameters hold no elements of their own.
    assert all(p.numel() == 0 for p in trainer.actor.module.parameters())
    initial = _full(trainer.actor)
    trainer.update(batches[0])
    trainer.save(str(tmp_path))
    saved_actor, saved_critic = _full(trainer.actor), _full(trainer.critic)
    assert any(not torch.equal(initial[k], saved_actor[k]) for k in initial), "no actor weight moved"
    trainer.update(batches[1])
    final_actor, final_critic = _full(trainer.actor), _full(trainer.critic)

    # The policy folder is the gathered weights (float32 on CPU), loadable without DeepSpeed.
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    for k, v in policy.state_dict().items():
        assert torch.equal(v, saved_actor[k]), k

    resumed = PPOTrainer(
        cfg, str(tmp_path / "policy"), critic_dir=str(tmp_path / "critic"), trainer_state_dir=str(tmp_path / "trainer")
    )
    for k, v in _full(resumed.critic).items():
        assert torch.equal(v, saved_critic[k]), k
    resumed.update(batches[1])
    # Bit-for-bit as in the stage 1-2 resume test: same fp32 master partitions, Adam state, LR step and
    # shuffle seed, same deterministic CPU kernels in the same order.
    for again, live in ((_full(resumed.actor), final_actor), (_full(resumed.critic), final_critic)):
        for k, v in again.items():
            assert torch.equal(v, live[k]), k


@pytest.mark.parametrize("stage, offload", [(2, "optimizer"), (3, "optimizer_and_params")])
def test_offload_takes_the_same_step_as_no_offload(tiny_model_dir, batches, stage, offload):
    """On the CPU accelerator offload moves nothing (everything is host memory already) but runs DeepSpeed's
    offload code path (its CPU-side optimizer step over the fp32 partitions): same torch AdamW on the same
    gradients, so the weights after one update must match the un-offloaded run's. Tolerance: fp32 rounding
    of the same arithmetic done over differently laid-out buffers (1e-6 absolute on weights of size ~0.02)."""
    results = []
    for mode in ("none", offload):
        cfg = _cfg(tiny_model_dir, **{"train.zero_stage": stage, "train.offload": mode})
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        zero = trainer.actor._config.zero_config
        assert (zero.offload_optimizer is not None) == (mode != "none")
        assert (zero.offload_param is not None) == (mode == "optimizer_and_params")
        trainer.update(batches[0])
        results.append((_full(trainer.actor), _full(trainer.critic)))
    for plain, offloaded in zip(*results):
        for k, v in plain.items():
            torch.testing.assert_close(offloaded[k], v, atol=1e-6, rtol=0, msg=k)


def _grads_at_first_step(trainer) -> dict[str, torch.Tensor]:
    """Run one update; return the actor's accumulated .grad tensors just before its first optimizer step
    (ZeRO stage 0 keeps them on the parameters)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer._engine_step

    def capture(role, engine):
        if role == "actor" and not grads and engine.is_gradient_accumulation_boundary():
            grads.update(
                {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
            )
        step(role, engine)

    trainer._engine_step = capture
    return grads


def test_gradient_checkpointing_gives_the_same_gradients_and_step(tiny_model_dir, batches):
    """model.gradient_checkpointing recomputes each decoder layer's forward during backward instead of keeping
    its activations: the same fp32 operations on the same inputs, so the same gradients. Differences allowed:
    fp32 rounding only (the untrimmed last-layer MLP under checkpointing, see forward.py, changes matmul shapes
    and so summation order): 1e-5 relative to each tensor's largest gradient."""
    runs = []
    for checkpointing in (False, True):
        cfg = _cfg(
            tiny_model_dir,
            **{
                "train.zero_stage": 0,
                "model.gradient_checkpointing": checkpointing,
                "train.ppo_epochs": 1,
                "algo.name": "grpo",
            },
        )
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        assert trainer.actor.module.is_gradient_checkpointing == checkpointing
        grads = _grads_at_first_step(trainer)
        trainer.update(batches[0])
        runs.append((grads, _full(trainer.actor)))
    (plain_grads, plain_weights), (ckpt_grads, ckpt_weights) = runs
    assert set(plain_grads) == set(ckpt_grads) and len(plain_grads) > 10  # every layer got its gradient
    for name, g in plain_grads.items():
        scale = float(g.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(ckpt_grads[name], g, atol=1e-5 * scale, rtol=0, msg=name)
    # Adam's first step is ~lr * sign(g): equal except where g is within rounding of 0 (as in test_trainer's
    # accumulation test): all weights within 2 * lr, all but a sliver (< 0.1%) within lr / 100.
    for k, v in plain_weights.items():
        delta = (ckpt_weights[k] - v).abs()
        assert float(delta.max()) <= 2e-3, k
        assert float((delta > 1e-5).float().mean()) < 1e-3, k


def test_resume_on_another_number_of_ranks_names_both_counts(tiny_model_dir, batches, tmp_path):
    import json

    # ZeRO-3: its partitions are not cut again for another count (ZeRO 0-2 resume: test_trainer_rank_rows.py)
    cfg = _cfg(tiny_model_dir, **{"algo.name": "grpo", "train.zero_stage": 3})
    PPOTrainer(cfg, str(tiny_model_dir)).save(str(tmp_path))
    meta_path = tmp_path / "trainer" / "trainer.json"
    meta = json.loads(meta_path.read_text())
    assert meta["world_size"] == 1
    meta_path.write_text(json.dumps(dict(meta, world_size=2)))  # as if written by 2 ranks
    with pytest.raises(ValueError, match=r"2 rank\(s\) but this trainer runs on 1"):
        PPOTrainer(cfg, str(tmp_path / "policy"), trainer_state_dir=str(tmp_path / "trainer"))
