"""The filter drops vLLM's per-reload "RotaryEmbedding: Failed to load weights" and nothing else (why it is
harmless: engines/rollout/vllm_process.RotaryReloadWarningFilter). Built like vLLM's own call in
vllm/model_executor/model_loader/reload/layerwise.py: logger.warning("%s: Failed to load weights", name)."""

import json
import logging

from engines.rollout.vllm_process import RotaryReloadWarningFilter, install_vllm_log_filter


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(
        "vllm.model_executor.model_loader.reload.layerwise", logging.WARNING, "layerwise.py", 266, msg, args, None
    )


def test_only_the_rotary_reload_warning_is_dropped():
    keep = RotaryReloadWarningFilter().filter
    assert keep(_record("%s: Failed to load weights", "RotaryEmbedding")) is False
    assert keep(_record("%s: Failed to load weights", "QKVParallelLinear")) is True  # a real failure still shows
    assert keep(_record("Reloading weights inplace...")) is True


def test_the_logging_config_handed_to_vllm_keeps_its_handlers_and_adds_the_filter(tmp_path, monkeypatch):
    # setenv, not delenv: monkeypatch then restores the variable as it was before the test (unset), not the path
    # install_vllm_log_filter wrote, which points into this test's tmp_path, gone once it passes (a later vLLM engine
    # in the same test process would fail to start on it).
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "")
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    install_vllm_log_filter(str(tmp_path))
    import os

    config = json.loads(open(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read())
    assert config["loggers"]["vllm"]["handlers"] == ["vllm"]
    assert config["handlers"]["vllm"]["filters"] == ["ppoflow_rotary_reload"]
    assert config["filters"]["ppoflow_rotary_reload"]["()"].endswith("vllm_process.RotaryReloadWarningFilter")
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(mine))  # a config the user set is kept
    install_vllm_log_filter(str(tmp_path / "other"))
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(mine)
