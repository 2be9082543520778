"""PPOTrainer on real DeepSpeed (CPU accelerator, gloo): update, save/load, resume, gradient accumulation."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from engines.scoring.reference import ReferenceModel
from engines.trainer.experience import ExperienceBatch
from engines.trainer.ppo_trainer import PPOTrainer
from engines.trainer.state import load_nested
from engines.weights_digest import policy_record
from ppoflow.config import load_config

pytestmark = pytest.mark.slow


def _cfg(model_dir, **overrides):
    settings = {
        "model.policy_path": str(model_dir),
        "rollout.prompts_per_iteration": 4,
        "rollout.n_samples": 2,
        "train.micro_batch_size": 4,
        "train.train_batch_size": 8,
        "train.actor_lr": 1e-3,
        "train.critic_lr": 1e-3,
        "train.ppo_epochs": 2,
        "train.warmup_steps": 1,
        "run.iterations": 5,
    }
    settings.update(overrides)
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


def _batch(model_dir, seed: int) -> ExperienceBatch:
    """8 samples in 4 groups of 2 with varied prompt/response lengths and real reference log-probs."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(4, 64) for _ in range(rng.randrange(2, 6))] for _ in range(4)]
    prompt_ids = [p for p in prompts for _ in range(2)]
    response_ids = [[rng.randrange(4, 64) for _ in range(rng.randrange(1, 7))] for _ in range(8)]
    reference = ReferenceModel(str(model_dir), micro_batch_size=8)
    return ExperienceBatch.from_lists(
        prompt_ids,
        response_ids,
        scores=[rng.random() for _ in range(8)],
        ref_logprobs=reference.logprobs(prompt_ids, response_ids),
        group_ids=[i // 2 for i in range(8)],
    )


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    return _batch(tiny_model_dir, 1), _batch(tiny_model_dir, 2)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, batches, tmp_path_factory):
    """A PPO trainer after one update, saved; then a second update (the uninterrupted run). ZeRO-2, whose flat
    fp32 partition the tests read (float32 weights default to stage 0: test_zero_stage_0_resume_...)."""
    out = tmp_path_factory.mktemp("ckpt")
    trainer = PPOTrainer(_cfg(tiny_model_dir, **{"train.zero_stage": 2}), str(tiny_model_dir))
    initial = _params(trainer.actor)
    first = trainer.update(batches[0])
    hashed = trainer.save(str(out), extra_state={"data_cursor": 1})
    saved_actor, saved_critic = _params(trainer.actor), _params(trainer.critic)
    second = trainer.update(batches[1])
    return dict(
        out=out,
        hashed=hashed,
        initial=initial,
        first=first,
        saved_actor=saved_actor,
        saved_critic=saved_critic,
        second=second,
        final_actor=_params(trainer.actor),
        final_critic=_params(trainer.critic),
        trainer=trainer,
    )


def test_save_returns_the_hashes_of_the_state_files_it_wrote(trained):
    from storage.checkpoints import file_sha256

    hashed = trained["hashed"]
    assert {
        "trainer/actor_optimizer.safetensors",
        "trainer/critic_optimizer.safetensors",
        "trainer/rng.safetensors",
        "trainer/actor_optimizer.json",
    } <= set(hashed)
    for rel, digest in hashed.items():  # hashed while writing == hashed by reading the file back
        assert digest == file_sha256(str(trained["out"] / rel)), rel


def test_an_optimizer_state_write_that_fails_fails_the_save(trained, tmp_path, monkeypatch):
    """The optimizer state is written on a second thread beside the weights: its error reaches the caller, after the
    weights' own write has ended (nothing is left writing into a folder the caller will clean up)."""
    import engines.trainer.checkpoint as checkpoint

    written = checkpoint.save_optimizer

    def fail_for_the_critic(engine, folder, stem):
        if stem.startswith("critic"):
            raise OSError(28, "No space left on device", str(folder))
        return written(engine, folder, stem)

    monkeypatch.setattr(checkpoint, "save_optimizer", fail_for_the_critic)
    with pytest.raises(OSError, match="No space left on device"):
        trained["trainer"].save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "policy" / "model.safetensors").is_file()  # the weights' write ran to its end
    assert not (tmp_path / "ckpt" / "trainer" / "trainer.json").exists()  # the save stopped before its record


def test_the_recorded_policy_digest_is_the_saved_folders(trained, tiny_model_dir):
    """trainer.json's policy_digest, taken from the actor's weights in memory, equals the record read back from the
    policy folder the save wrote (safetensors' own reader), and differs from the initial model's (one update ran)."""
    meta = json.loads((trained["out"] / "trainer" / "trainer.json").read_text())
    from_folder = policy_record(trained["out"] / "policy", None)
    assert meta["policy_digest"] == from_folder
    assert from_folder["value"] != policy_record(tiny_model_dir, None)["value"]


def test_update_trains_and_reports_metrics(trained, batches):
    first = trained["first"]
    for key in (
        "loss/policy",
        "loss/value",
        "policy/clipfrac",
        "policy/approx_kl",
        "policy/entropy",
        "value/clipfrac",
        "optim/actor_grad_norm",
        "optim/critic_grad_norm",
        "optim/actor_lr",
        "optim/critic_lr",
        "kl/mean",
        "kl/coef",
        "reward/mean",
    ):
        assert key in first.metrics and torch.isfinite(torch.tensor(first.metrics[key])), key
    # Warm-up of 1 step then constant: the last step of the update ran at the full 1e-3.
    assert first.metrics["optim/actor_lr"] == pytest.approx(1e-3)
    assert first.metrics["reward/mean"] == pytest.approx(float(batches[0].scores.mean()))
    changed = [k for k in trained["initial"] if not torch.equal(trained["initial"][k], trained["saved_actor"][k])]
    assert changed, "no actor parameter moved"
    lengths = batches[0].response_mask.sum(1).long().tolist()
    assert [len(x) for x in first.advantages] == lengths == [len(x) for x in first.values]


def test_first_old_logprobs_match_reference(trained, batches):
    # Before any step the actor IS the reference: old log-probs equal the reference's, so k1 KL = 0.
    # Tolerance: same weights, same padding layout, but a DeepSpeed-wrapped module; fp32 noise only.
    for old, ref in zip(trained["first"].old_logprobs, batches[0].ref_logprobs):
        torch.testing.assert_close(torch.tensor(old), ref[: len(old)], atol=1e-5, rtol=0)
    assert abs(trained["first"].metrics["kl/mean"]) < 1e-5


def test_saved_checkpoint_is_open_format_and_reloads(trained, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = trained["out"]
    assert not [p for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pickle")]
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    for k, v in policy.state_dict().items():
        assert torch.equal(v, trained["saved_actor"][k]), k
    meta = json.loads((out / "trainer" / "trainer.json").read_text())
    assert meta["update_count"] == 1 and meta["extra_state"] == {"data_cursor": 1}
    state = load_nested(out / "trainer", "actor_optimizer")
    # AdamW state of the one flat fp32 partition: 2 steps = 2 epochs x (8 samples / 8 per optimizer step).
    adam = state["base_optimizer_state"]["state"][0]
    assert float(adam["step"]) == 2.0 and adam["exp_avg"].shape == state["single_partition_of_fp32_groups"][0].shape
    assert "base_optimizer_state/state/0/exp_avg" in load_file(str(out / "trainer" / "actor_optimizer.safetensors"))


def test_resume_then_update_equals_uninterrupted(trained, tiny_model_dir, batches):
    out = trained["out"]
    resumed = PPOTrainer(
        _cfg(tiny_model_dir, **{"train.zero_stage": 2}),
        str(out / "policy"),
        critic_dir=str(out / "critic"),
        trainer_state_dir=str(out / "trainer"),
    )
    for k, v in _params(resumed.actor).items():
        assert torch.equal(v, trained["saved_actor"][k]), k
    for k, v in _params(resumed.critic).items():
        assert torch.equal(v, trained["saved_critic"][k]), k
    # Optimizer state identical to the one saved (and to the live trainer's before its second update).
    saved = load_nested(out / "trainer", "actor_optimizer")["base_optimizer_state"]["state"][0]
    live = resumed.actor.optimizer.state_dict()["base_optimizer_state"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(live[key], saved[key]), key
    assert resumed.extra_state == {"data_cursor": 1} and resumed.update_count == 1
    second = resumed.update(batches[1])
    # Bit-for-bit: same weights, optimizer state, LR step and shuffle seed, and the same deterministic
    # fp32 CPU kernels in the same order, so nothing may differ at all.
    for k, v in _params(resumed.actor).items():
        assert torch.equal(v, trained["final_actor"][k]), k
    for k, v in _params(resumed.critic).items():
        assert torch.equal(v, trained["final_critic"][k]), k
    assert second.metrics["loss/policy"] == trained["second"].metrics["loss/policy"]


def test_a_fresh_trainer_seeds_every_generator_it_checkpoints_from_the_run(tiny_model_dir):
    """The RNG states a checkpoint holds (Python's, numpy's, torch's) are, right after a fresh trainer is built,
    a function of run.seed alone: the same after a process drew from all three generators as before, and what a
    generator seeded by hand with run.seed holds (a rank process that drew nothing commits the same bytes)."""
    import numpy as np

    from engines.trainer.state import rng_state

    cfg = _cfg(tiny_model_dir, **{"run.seed": 7})
    states = []
    for draws in (0, 3):
        for _ in range(draws):  # some other work of this process in between
            random.random(), np.random.rand(), torch.rand(1)
        PPOTrainer(cfg, str(tiny_model_dir))
        states.append(rng_state())
    first, second = states
    assert first["python"] == second["python"] == random.Random(7).getstate()
    assert torch.equal(first["numpy"]["keys"], second["numpy"]["keys"])
    assert first["numpy"]["pos"] == second["numpy"]["pos"]
    assert (first["numpy"]["keys"].numpy() == np.random.RandomState(7).get_state()[1]).all()
    assert torch.equal(first["torch"], second["torch"])


def test_gradient_accumulation_does_not_change_the_step(tiny_model_dir, batches):
    """One optimizer step over 8 samples as 1 micro-batch of 8 or 4 micro-batches of 2."""
    results = []
    for micro in (8, 2):
        cfg = _cfg(
            tiny_model_dir,
            **{
                "algo.name": "grpo",
                "train.micro_batch_size": micro,
                "train.ppo_epochs": 1,
                "train.warmup_steps": 0,
                "train.actor_lr": 1e-4,
            },
        )
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        assert trainer.actor.gradient_accumulation_steps() == 8 // micro
        before = _params(trainer.actor)
        metrics = trainer.update(batches[0]).metrics
        results.append((before, _params(trainer.actor), metrics))
    (before, one, m1), (_, four, m4) = results
    # The token-mean loss over the step is the same number however it is split (fp32 summation order).
    assert m1["loss/policy"] == pytest.approx(m4["loss/policy"], abs=1e-6)
    assert m1["optim/actor_grad_norm"] == pytest.approx(m4["optim/actor_grad_norm"], rel=1e-4)
    # Adam's first step moves each weight by lr * g / (|g| + eps) ~ lr * sign(g): gradients equal up to
    # fp32 reassociation (~1e-7 relative) give updates equal to far below lr = 1e-4, except where g is
    # within rounding of 0 (there the two splits may disagree by up to lr). So: every weight within
    # 2 * lr, and all but a sliver (< 0.1%) within lr / 100.
    for k in before:
        delta = (one[k] - four[k]).abs()
        assert float(delta.max()) <= 2e-4, k
        assert float((delta > 1e-6).float().mean()) < 1e-3, k
    moved = sum(int((one[k] != before[k]).sum()) for k in before)
    assert moved > 1000


def test_old_values_from_the_first_forward_equal_a_separate_pass(tiny_model_dir, batches, monkeypatch):
    """Whole batch = one step of one micro-batch: the first epoch's forward gives the old log-probs/values.

    The second implementation is the separate no-grad pass (forced by switching the reuse off); both
    trainers start from the same seed, so old log-probs, values, advantages and weights must agree.
    """
    cfg = _cfg(tiny_model_dir, **{"train.micro_batch_size": 8, "train.warmup_steps": 0})
    results = []
    for reuse in (True, False):
        trainer = PPOTrainer(cfg, str(tiny_model_dir))
        if reuse:
            assert trainer._old_from_first_forward(batches[0].to(trainer.device))

            def no_separate_pass(*_):
                raise AssertionError("the separate old-log-prob pass ran although the first forward could serve")

            monkeypatch.setattr(trainer, "_old_logprobs_and_values", no_separate_pass)
        else:
            monkeypatch.setattr(trainer, "_old_from_first_forward", lambda _batch: False)
        result = trainer.update(batches[0])
        results.append((result, _params(trainer.actor), _params(trainer.critic)))
    (fused, actor_a, critic_a), (separate, actor_b, critic_b) = results
    for name in ("old_logprobs", "values", "advantages", "returns"):
        for a, b in zip(getattr(fused, name), getattr(separate, name)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0, msg=name)
    assert fused.metrics["loss/policy"] == pytest.approx(separate.metrics["loss/policy"], abs=1e-5)
    # Two epochs of Adam from equal gradients up to fp32 summation order (rows in batch order vs shuffled):
    # as in the accumulation test, all but a sliver of weights agree to far below lr = 1e-3.
    for ours, theirs in ((actor_a, actor_b), (critic_a, critic_b)):
        for k in ours:
            delta = (ours[k] - theirs[k]).abs()
            assert float(delta.max()) <= 4e-3, k
            assert float((delta > 1e-5).float().mean()) < 1e-2, k


def test_bf16_autocast_keeps_float32_state_and_close_logprobs(tiny_model_dir, batches, tmp_path):
    """model.autocast_dtype=bfloat16 on ZeRO stage 0: weights and Adam state stay float32, and the trainer's
    log-probs are the float32 reference's up to bfloat16 rounding (8 mantissa bits: ~1e-2 on log-probs of
    a 64-token vocabulary), not equal to them (so bfloat16 kernels really ran)."""
    cfg = _cfg(tiny_model_dir, **{"model.autocast_dtype": "bfloat16", "train.zero_stage": 0})
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    assert trainer.actor.enable_backward_allreduce is False  # one rank, stage 0: no reduction copy
    before = _params(trainer.actor)
    result = trainer.update(batches[0])
    old = torch.cat([torch.tensor(x) for x in result.old_logprobs])
    ref = torch.cat([r[: len(x)] for x, r in zip(result.old_logprobs, batches[0].ref_logprobs)])
    diff = (old - ref).abs()
    assert 0 < float(diff.max()) < 0.1
    after = _params(trainer.actor)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = trainer.actor.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    trainer.save(str(tmp_path))  # the checkpoint's record holds the digest rounded to bfloat16 too, as the folder's
    meta = json.loads((tmp_path / "trainer" / "trainer.json").read_text())
    assert meta["policy_digest"] == policy_record(tmp_path / "policy", "bfloat16")
    assert set(meta["policy_digest"]["rounded"]) == {"bfloat16"}
    bf16_ref = ReferenceModel(str(tiny_model_dir), micro_batch_size=8, autocast_dtype="bfloat16")
    assert bf16_ref.fingerprint != ReferenceModel(str(tiny_model_dir), micro_batch_size=8).fingerprint


def test_zero_stage_0_resume_equals_uninterrupted(tiny_model_dir, batches, tmp_path):
    """Stage 0 keeps torch's AdamW state dict (no ZeRO partitions): save, rebuild, continue, bit-for-bit."""
    cfg = _cfg(tiny_model_dir, **{"train.zero_stage": 0})
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    trainer.update(batches[0])
    trainer.save(str(tmp_path))
    trainer.update(batches[1])
    resumed = PPOTrainer(
        cfg, str(tmp_path / "policy"), critic_dir=str(tmp_path / "critic"), trainer_state_dir=str(tmp_path / "trainer")
    )
    resumed.update(batches[1])
    for live, again in ((trainer.actor, resumed.actor), (trainer.critic, resumed.critic)):
        for k, v in _params(again).items():
            assert torch.equal(v, _params(live)[k]), k


def test_adaptive_kl_controller_sees_the_kl_per_sequence(tiny_model_dir, batches):
    """algo.kl_target is per response (Ziegler et al.: KL summed over a response's tokens, averaged over
    responses). Derived by hand from the update's own old log-probs and the batch's reference log-probs
    (k1: old - ref per token); a per-token mean would be ~3.5x smaller on these responses (1-6 tokens)."""
    cfg = _cfg(tiny_model_dir, **{"algo.kl_target": 0.01, "algo.kl_horizon": 1000, "algo.kl_coef": 0.1})
    trainer = PPOTrainer(cfg, str(tiny_model_dir))
    trainer.update(batches[0])  # the actor moves away from the reference, so the second update sees KL > 0
    seen: list[float] = []
    controller_update = trainer.kl_controller.update
    trainer.kl_controller.update = lambda kl, n: (seen.append(kl), controller_update(kl, n))[1]
    beta_before = trainer.kl_controller.value
    result = trainer.update(batches[1])
    per_row = [
        sum(o - float(r) for o, r in zip(old, ref)) for old, ref in zip(result.old_logprobs, batches[1].ref_logprobs)
    ]
    per_sequence = sum(per_row) / len(per_row)
    per_token = sum(per_row) / sum(len(old) for old in result.old_logprobs)
    assert abs(per_sequence) > 1.5 * abs(per_token) > 0  # the two readings are far apart here
    assert seen == [pytest.approx(per_sequence, rel=1e-4)]
    assert result.metrics["kl/sequence_mean"] == pytest.approx(per_sequence, rel=1e-4)
    error = min(max(per_sequence / 0.01 - 1.0, -0.2), 0.2)
    assert trainer.kl_controller.value == pytest.approx(beta_before * (1 + error * 8 / 1000), rel=1e-9)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_tied_head_trains_as_with_a_dense_embedding_gradient(tmp_path, monkeypatch, zero_stage):
    """SmolLM2's head shares the embedding's weight: its embedding gradient comes as the batch's rows
    (engines/trainer/tied_embedding.py), added into the gradient in place at ZeRO stage 0, as sparse rows at stage 2.
    Through DeepSpeed (2 micro-batches a step: the rows of both accumulate) the step equals the dense-gradient step
    (the switch turned off from outside), up to Adam's sign rounding near g = 0 (the bound of the
    gradient-accumulation test)."""
    from transformers import LlamaForCausalLM

    from engines.toy.model import ToyShape, build_toy_model

    tied_dir = build_toy_model(LlamaForCausalLM, tmp_path / "tied", ToyShape(), seed=0, tie_word_embeddings=True)
    batch = _batch(tied_dir, 1)
    cfg = _cfg(
        tied_dir,
        **{
            "algo.name": "grpo",
            "train.ppo_epochs": 1,
            "train.warmup_steps": 0,
            "train.actor_lr": 1e-4,
            "train.zero_stage": zero_stage,
        },
    )
    results = {}
    for rows in (True, False):
        if not rows:
            monkeypatch.setattr("engines.trainer.lora.tied_input_gradient_as_rows", lambda model, in_place: "")
        trainer = PPOTrainer(cfg, str(tied_dir))
        embedding = trainer.actor.module.get_input_embeddings()
        # which way: stage 0 replaces the embedding's forward (in place), stage 2 sets sparse; off: neither
        assert ("forward" in vars(embedding), embedding.sparse) == (rows and zero_stage == 0, rows and zero_stage == 2)
        before = _params(trainer.actor)
        trainer.update(batch)
        results[rows] = (before, _params(trainer.actor))
    (before, with_rows), (_, dense) = results[True], results[False]
    for k in before:
        delta = (with_rows[k] - dense[k]).abs()
        assert float(delta.max()) <= 2e-4, k
        assert float((delta > 1e-6).float().mean()) < 1e-3, k
    embedding = "model.embed_tokens.weight"
    assert int((with_rows[embedding] != before[embedding]).any(dim=1).sum()) > 32  # the tied weight moved
