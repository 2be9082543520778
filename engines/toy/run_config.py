"""The one builder of a toy run's config, shared by the demo, the tests and the benchmarks.

    toy_config(root, run, model_dir, data_dir, iterations=..., seed=..., sections={...}, overrides=[...])

starts from configs/demo.yaml (the recipe that learns the digits task: bench/learning.py measures it), fills
in where the run lives and which tiny model and dataset it uses, then applies `sections` (a nested dict
merged section by section: a test's small batch, a benchmark's workload) and `overrides` (`--set` strings).
Validation errors name the field as any config error does (ConfigError).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def toy_config(
    root: str | Path,
    run: str,
    model_dir: str | Path,
    data_dir: str | Path,
    *,
    iterations: Optional[int] = None,
    seed: Optional[int] = None,
    sections: Optional[dict[str, dict[str, Any]]] = None,
    overrides: Sequence[str] = (),
):
    """A PPOFlowConfig for a toy run (see the module docstring); iterations/seed None keep the demo's."""
    from ppoflow.config import apply_overrides, build_config

    data = yaml.safe_load(DEMO_CONFIG.read_text())
    data["run"].update({"name": run, "root": str(root)})
    data["run"].update({k: v for k, v in (("iterations", iterations), ("seed", seed)) if v is not None})
    data.setdefault("model", {})["policy_path"] = str(model_dir)
    data.setdefault("data", {})["path"] = str(data_dir)
    for section, values in (sections or {}).items():
        data.setdefault(section, {}).update(values)
    return build_config(apply_overrides(data, list(overrides)), f"toy config {run!r}")
