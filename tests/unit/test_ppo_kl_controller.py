"""KL controllers: the proportional update by hand, direction properties, and JSON state round trips."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.ppo.kl_controller import (
    AdaptiveKLController,
    FixedKLController,
    kl_controller_from_state,
    make_kl_controller,
)
from ppoflow.config import AlgoConfig


class TestFixedKLController:
    def test_constant_and_round_trip(self):
        controller = FixedKLController(0.05)
        controller.update(current_kl=123.0, n_steps=64)
        assert controller.value == 0.05
        restored = kl_controller_from_state(json.loads(json.dumps(controller.state_dict())))
        assert isinstance(restored, FixedKLController) and restored.value == 0.05

    def test_negative_coef(self):
        with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
            FixedKLController(-0.1)


class TestAdaptiveKLController:
    def test_updates_by_hand(self):
        # target 1, horizon 100, 10 steps per update: beta *= 1 + error * 0.1
        controller = AdaptiveKLController(0.1, target=1.0, horizon=100)
        controller.update(1.1, 10)  # error 0.1 -> 0.1 * 1.01 = 0.101
        assert controller.value == pytest.approx(0.101)
        controller.update(5.0, 10)  # error 4 clipped to 0.2 -> * 1.02 = 0.10302
        assert controller.value == pytest.approx(0.10302)
        controller.update(0.5, 10)  # error -0.5 clipped to -0.2 -> * 0.98 = 0.1009596
        assert controller.value == pytest.approx(0.1009596)

    @settings(max_examples=50, deadline=None)
    @given(st.floats(0.01, 10), st.floats(0.01, 10), st.integers(1, 1000))
    def test_moves_towards_target(self, target, current_kl, n_steps):
        controller = AdaptiveKLController(0.2, target, horizon=10_000)
        controller.update(current_kl, n_steps)
        if current_kl > target * (1 + 1e-9):
            assert controller.value > 0.2
        elif current_kl < target * (1 - 1e-9):
            assert controller.value < 0.2

    def test_resume_from_json_equals_uninterrupted(self):
        observed = [0.3, 2.5, 1.7, 0.9, 4.0, 0.1]
        uninterrupted = AdaptiveKLController(0.05, target=1.0, horizon=500)
        for kl in observed:
            uninterrupted.update(kl, 32)
        first_half = AdaptiveKLController(0.05, target=1.0, horizon=500)
        for kl in observed[:3]:
            first_half.update(kl, 32)
        saved = json.dumps(first_half.state_dict())  # what goes into the checkpoint
        resumed = kl_controller_from_state(json.loads(saved))
        for kl in observed[3:]:
            resumed.update(kl, 32)
        assert resumed.value == uninterrupted.value  # exact: JSON floats round-trip bit for bit
        assert resumed.state_dict() == uninterrupted.state_dict()

    def test_rejects_bad_state_and_input(self):
        controller = AdaptiveKLController(0.1, 1.0, 100)
        with pytest.raises(ValueError, match="state is for 'fixed'"):
            controller.load_state_dict(FixedKLController(0.1).state_dict())
        with pytest.raises(ValueError, match="lacks"):
            controller.load_state_dict({"kind": "adaptive", "value": 0.1})
        with pytest.raises(ValueError, match="current_kl must be a finite number"):
            controller.update(float("nan"), 1)
        with pytest.raises(ValueError, match="kl_target and kl_horizon must be > 0"):
            AdaptiveKLController(0.1, 0.0, 100)


class TestMakeKLController:
    def test_from_algo_config(self):
        fixed = make_kl_controller(AlgoConfig(kl_coef=0.02))
        assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
        adaptive = make_kl_controller(AlgoConfig(kl_coef=0.02, kl_target=6.0, kl_horizon=1000))
        assert isinstance(adaptive, AdaptiveKLController)
        assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 6.0, 1000)
