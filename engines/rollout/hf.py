"""Rollout with Hugging Face `generate`: batched, `n` samples per prompt, per-prompt seeds.

How sampling is done: `generate` runs the KV-cache decoding loop, stopping (EOS + extra stop ids) and
padding, in greedy mode; the last logits processor, `_SeededSampler`, draws each row's token itself
(temperature, then top-k, then top-p, then inverse-CDF sampling with the row's next uniform) and returns
scores that are -inf everywhere except the drawn token, so greedy picks exactly that token. Each row's
uniforms (one per new token) are drawn up front from that row's own `torch.Generator`, so `seeds[i]` fixes
prompt i's samples whatever else is in the batch (a single global RNG cannot), while the draw itself is one
batched `searchsorted` per step instead of one `multinomial` call per row and step.

Precision: `autocast_dtype="bfloat16"` runs the model's matmuls in bfloat16 under `torch.autocast`
(weights stay in `dtype`), the setting the trainer uses for its forwards (`model.autocast_dtype`); the
logits are upcast to float32 before sampling and log-probs.

Log-probs: from `output_logits` (the model's raw logits, before any processor) divided by the temperature,
log-softmaxed over the full vocabulary, at the drawn token. They are NOT taken after top-k/top-p
truncation: the trainer recomputes log pi(token) / T over the full vocabulary, and the two must agree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from engines.models import autocast, load_policy, load_tokenizer, precast_linear_weights, weight_files
from engines.rollout.base import RolloutSample, SamplingSettings
from engines.weights_digest import WeightsDigest, module_digest


def row_seed(prompt_seed: int, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a prompt seeded `prompt_seed` (63-bit)."""
    digest = hashlib.sha256(f"{prompt_seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _read_config(folder: Path) -> Optional[dict]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def warp_scores(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, top-k (-1 = off), top-p (1.0 = off) on (B, V) logits; removed tokens get -inf."""
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first token is always kept).
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids (B,) drawn from `probs` (B, V) (rows need not be normalised) with `uniforms` (B,) in [0, 1).

    Token v is chosen when u * total falls in [cdf[v-1], cdf[v]): probability probs[v] / total, and a
    zero-probability token is never chosen (its interval is empty). The CDF is summed in float64 so a
    150k-token vocabulary loses no small probabilities to rounding.
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    x = uniforms.to(device=cdf.device, dtype=torch.float64)[:, None] * total
    # u * total can round up to total itself for u just below 1: keep x strictly inside the last interval
    x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


class _SeededSampler:
    """Logits processor: row r's token from its own pre-drawn uniforms; scores one-hot-masked to it.

    uniforms: (B, max_new_tokens) float64, row r drawn from generators[r]; column t serves new token t.
    """

    def __init__(self, generators: list[torch.Generator], sampling: SamplingSettings):
        self.sampling = sampling
        self.uniforms = torch.stack(
            [torch.rand(sampling.max_new_tokens, generator=g, dtype=torch.float64) for g in generators]
        )
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        if self.step >= self.uniforms.shape[1]:
            raise RuntimeError(f"the sampler was asked for token {self.step + 1} of max_new_tokens={s.max_new_tokens}")
        probs = warp_scores(scores, s.temperature, s.top_k, s.top_p).softmax(-1)
        chosen = inverse_cdf_sample(probs, self.uniforms[:, self.step])
        self.step += 1
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None].to(scores.device), 0.0)
        return out


class HFRolloutEngine:
    """RolloutEngine on `transformers` generate. Long-lived; `load_weights` swaps in a new policy folder."""

    name = "hf"

    def __init__(
        self,
        policy_dir: str,
        *,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        autocast_dtype: Optional[str] = None,
        seed: int = 0,
        device: str = "cpu",
        max_batch_size: int = 256,
    ):
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self.autocast_dtype = autocast_dtype
        self.seed = seed
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        self._calls = 0  # seeds the unseeded calls, so two calls never repeat each other
        self.model = None
        self._load(policy_dir)

    def _load(self, policy_dir: str) -> None:
        self.tokenizer = load_tokenizer(policy_dir)
        model = load_policy(policy_dir, self.dtype, self.attn_implementation)
        self.model = model.to(self.device).eval().requires_grad_(False)
        precast_linear_weights(self.model, self.autocast_dtype)  # one cast per weight load, not per token
        self.policy_dir = str(Path(policy_dir))
        self._config_json = _read_config(Path(policy_dir))
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)

    def load_weights(self, policy_dir: str, version: int) -> None:
        """Serve the HF folder `policy_dir` as `version`.

        A folder of the model already loaded (same config.json, safetensors weights) is copied into it in
        place: no model rebuild, tokenizer kept. Anything else (another architecture, other weight names)
        loads model and tokenizer anew. Raises FileNotFoundError when `policy_dir` has no config.json.
        """
        if not self._copy_weights_in_place(Path(policy_dir)):
            self._load(policy_dir)
        self.policy_dir = str(Path(policy_dir))
        self.policy_version = int(version)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Serve weights handed over in memory (a trainer's actor in the same process) as `version`.

        state_dict: the actor module's `state_dict()` (same architecture: strict, a missing or unexpected
        name is an error naming it). Copied, so the trainer may keep updating its own tensors.
        """
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
        self.policy_version = int(version)

    def _copy_weights_in_place(self, folder: Path) -> bool:
        """Copy `folder`'s safetensors into the loaded model; False, with nothing copied, when they do not fit.

        Names and shapes are checked from the files' headers before any tensor is copied, so a folder that
        does not fit leaves the served model untouched.
        """
        from safetensors import safe_open
        from safetensors.torch import load_file

        files = weight_files(folder)
        if self.model is None or not files or _read_config(folder) != self._config_json:
            return False
        params = self.model.state_dict()
        names: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name not in params or tuple(params[name].shape) != tuple(f.get_slice(name).get_shape()):
                        return False
                    names.add(name)
        # Names not in the files must be tied to one that is (lm_head <- embed_tokens).
        copied_storage = {params[name].data_ptr() for name in names}
        if any(params[name].data_ptr() not in copied_storage for name in set(params) - names):
            return False
        with torch.no_grad():
            for path in files:
                for name, tensor in load_file(str(path)).items():
                    params[name].copy_(tensor)
        return True

    @property
    def digest_precision(self):
        """The precision its weights are compared at: the autocast dtype its Linear weights are held in, if any."""
        return self.autocast_dtype

    def weights_digest(self) -> WeightsDigest:
        """The digest of the weights the sampler holds (engines/weights_digest.py), at digest_precision."""
        return module_digest(self.model, self.digest_precision)

    def shutdown(self) -> None:
        self.model = None

    def _check_prompts(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if self.max_positions and len(p) + sampling.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                    f"it exceeds the model's {self.max_positions} positions"
                )

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, seeds: Optional[Sequence[int]] = None
    ) -> list[RolloutSample]:
        """`sampling.n` samples per prompt, ordered by (prompt_index, sample_index). See the module docstring."""
        self._check_prompts(prompts, sampling)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        self._calls += 1
        if seeds is None:
            seeds = [row_seed(self.seed * 1_000_003 + self._calls, i) for i in range(len(prompts))]
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        samples: list[RolloutSample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            samples.extend(self._generate_rows(chunk, prompts, seeds, sampling))
        return samples

    def _generate_rows(self, rows, prompts, seeds, sampling: SamplingSettings) -> list[RolloutSample]:
        from transformers import GenerationConfig, LogitsProcessorList

        pad_id = self.tokenizer.pad_token_id
        stop_ids = {self.tokenizer.eos_token_id, *sampling.stop_token_ids} - {None}
        width = max(len(prompts[i]) for i, _ in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (i, _) in enumerate(rows):  # left padding: every response starts at column `width`
            input_ids[r, width - len(prompts[i]) :] = torch.tensor(list(prompts[i]))
            attention_mask[r, width - len(prompts[i]) :] = 1
        generators = [torch.Generator().manual_seed(row_seed(int(seeds[i]), j)) for i, j in rows]
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=sorted(stop_ids),
            pad_token_id=pad_id,
            num_beams=1,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with torch.no_grad(), autocast(self.autocast_dtype, self.device):
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList([_SeededSampler(generators, sampling)]),
            )
        generated = out.sequences[:, width:].cpu()
        # (B, new_tokens, V) raw logits -> log-probs at the temperature over the full vocabulary.
        logits = torch.stack(out.logits, dim=1).float().cpu()
        logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
        token_logprobs = logprobs.gather(-1, generated[..., None]).squeeze(-1)
        return [
            self._to_sample(r, i, j, prompts[i], generated[r], token_logprobs[r], stop_ids)
            for r, (i, j) in enumerate(rows)
        ]

    def _to_sample(self, r, prompt_index, sample_index, prompt, tokens, token_logprobs, stop_ids) -> RolloutSample:
        ids = tokens.tolist()
        length, finish = len(ids), "length"
        for t, tok in enumerate(ids):  # after the first stop token generate only pads
            if tok in stop_ids:
                length, finish = t + 1, "stop"
                break
        return RolloutSample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=list(prompt),
            response_ids=ids[:length],
            rollout_logprobs=token_logprobs[:length].tolist(),
            finish_reason=finish,
            policy_version=self.policy_version,
        )
