"""KL coefficient controllers. Their state goes into every checkpoint, so a resumed run continues
with the same coefficient it would have had without the interruption.

Fixed:    beta stays at its initial value.
Adaptive: Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"), a proportional
          controller that steers the measured KL towards a target:
              error = clip(KL_current / KL_target - 1, -0.2, 0.2)
              beta <- beta * (1 + error * n_steps / horizon)
          n_steps = samples (or steps) since the last update; horizon = how many of them it takes to move
          beta by the full error. Clipping the error bounds the change per update to +-20% of
          n_steps / horizon, so one noisy KL estimate cannot swing beta.

state_dict() is a plain JSON-able dict; load_state_dict() checks its kind and raises ValueError naming
the mismatch.
"""

from __future__ import annotations

import math
from typing import Any, Union


def _finite_non_negative(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


class FixedKLController:
    """A constant KL coefficient. `.value` is beta; update() only checks its input."""

    kind = "fixed"

    def __init__(self, coef: float):
        self.value = _finite_non_negative("kl_coef", coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        _finite_non_negative("n_steps", n_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, "value")
        self.value = _finite_non_negative("value", state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller (module docstring). `.value` is the current beta."""

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: float):
        self.value = _finite_non_negative("kl_coef", init_coef)
        self.target = _finite_non_negative("kl_target", target)
        self.horizon = _finite_non_negative("kl_horizon", horizon)
        if self.target == 0 or self.horizon == 0:
            raise ValueError(f"kl_target and kl_horizon must be > 0, got {target!r} and {horizon!r}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards keeping `current_kl` (mean KL per sequence, nats) at the target.

        Raises ValueError for a non-finite current_kl (a NaN would poison beta for the rest of the run)
        or a negative n_steps.
        """
        if not (isinstance(current_kl, (int, float)) and math.isfinite(current_kl)):
            raise ValueError(f"current_kl must be a finite number, got {current_kl!r}")
        steps = _finite_non_negative("n_steps", n_steps)
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, "value", "target", "horizon")
        restored = AdaptiveKLController(state["value"], state["target"], state["horizon"])  # validates
        self.value, self.target, self.horizon = restored.value, restored.target, restored.horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


KLController = Union[FixedKLController, AdaptiveKLController]


def _check_kind(state: dict[str, Any], kind: str, *keys: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"KL controller state is for {found!r}, cannot load it into a {kind!r} controller")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"KL controller state for {kind!r} lacks {missing}; got keys {sorted(state)}")


def make_kl_controller(algo_cfg) -> KLController:
    """From ppoflow.config.AlgoConfig: adaptive when algo.kl_target is set, fixed at algo.kl_coef otherwise."""
    if algo_cfg.kl_target is None:
        return FixedKLController(algo_cfg.kl_coef)
    return AdaptiveKLController(algo_cfg.kl_coef, algo_cfg.kl_target, algo_cfg.kl_horizon)


def kl_controller_from_state(state: dict[str, Any]) -> KLController:
    """Rebuild a controller of the right kind from state_dict() output (e.g. read from a checkpoint)."""
    kinds = {
        FixedKLController.kind: lambda: FixedKLController(0.0),
        AdaptiveKLController.kind: lambda: AdaptiveKLController(0.0, 1.0, 1.0),
    }
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind not in kinds:
        raise ValueError(f"KL controller state has kind {kind!r}; expected one of {sorted(kinds)}")
    controller = kinds[kind]()
    controller.load_state_dict(state)
    return controller
