"""model.autocast_dtype=bfloat16 on a CPU without bfloat16 matmul kernels: detected (engines/precision.py) and
refused before any work (flows/preflight_static.py for `train`, flows/rm_training.py for `train-rm`).

We cannot run on other CPUs, so most cases mock what torch reports about the CPU (its capability string,
oneDNN's bfloat16 check, CUDA); the cases marked "this machine" check the real answers here.
"""

from __future__ import annotations

import platform

import pytest
import torch

from engines import precision
from engines.precision import bf16_matmul_slowdown, cpu_autocast_problem, cpu_bf16
from flows.preflight_static import PreflightError, precision_problem, static_problems
from ppoflow.config import load_config


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(capability, kernels): torch reports that CPU, no CUDA; the timed matmul says 21.4x."""

    def install(capability: str, kernels: bool) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: kernels)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(precision, "bf16_matmul_slowdown", lambda: 21.4)

    return install


class TestCpuAutocastProblem:
    def test_avx512_bf16_cpu_passes_without_timing(self, fake_cpu, monkeypatch):
        fake_cpu("AVX512", kernels=True)  # e.g. a Sapphire Rapids or Zen 4: AVX512-BF16, oneDNN's kernels

        def no_timing():
            raise AssertionError("a CPU with bfloat16 kernels needs no timed matmul")

        monkeypatch.setattr(precision, "bf16_matmul_slowdown", no_timing)
        assert cpu_bf16() == ("AVX512", True)
        assert cpu_autocast_problem("bfloat16") is None

    def test_avx2_cpu_is_refused_with_capability_slowdown_and_fix(self, fake_cpu):
        fake_cpu("AVX2", kernels=False)
        assert cpu_bf16() == ("AVX2", False)
        problem = cpu_autocast_problem("bfloat16")
        assert problem.startswith("model.autocast_dtype=bfloat16 ")
        assert "torch reports AVX2" in problem
        assert "ran 21x slower than float32" in problem  # the faked measurement, rounded
        assert problem.endswith("--set model.autocast_dtype=null")

    def test_no_autocast_or_a_gpu_is_never_refused(self, fake_cpu, monkeypatch):
        fake_cpu("AVX2", kernels=False)
        assert cpu_autocast_problem(None) is None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cpu_autocast_problem("bfloat16") is None

    def test_bfloat16_is_not_the_default(self, tiny_model_dir):
        assert load_config(None, ["model.policy_path=" + str(tiny_model_dir)]).model.autocast_dtype is None


class TestThisMachine:
    @pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
    def test_kernels_agree_with_the_cpus_flags(self):
        # oneDNN has bfloat16 GEMMs on x86 from AVX-512 up (avx512_core: F, BW, VL, DQ), or AVX2 with
        # AVX-NE-CONVERT and AVX-VNNI; cpuinfo's flags (torch.cpu.get_capabilities) say so independently.
        flags = torch.cpu.get_capabilities()
        avx512_core = all(flags.get(f, False) for f in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"))
        avx2_vnni_2 = flags.get("avx_ne_convert", False) and flags.get("avx_vnni", False)
        assert cpu_bf16().kernels == (avx512_core or avx2_vnni_2)

    @pytest.mark.skipif(cpu_bf16().kernels, reason="this CPU has bfloat16 kernels: nothing is emulated")
    def test_emulated_bfloat16_matmul_is_measured_slower(self):
        # ENVIRONMENT.md: 0.3 GFLOP/s in bfloat16 against ~140 in float32 on this AVX2 EPYC; ~20x at 128^3.
        threads = torch.get_num_threads()
        assert bf16_matmul_slowdown() > 4
        assert torch.get_num_threads() == threads


class TestPreflight:
    def _overrides(self, tiny_model_dir, digits_dataset_dir, tmp_path) -> list[str]:
        return [
            "model.policy_path=" + str(tiny_model_dir),
            "data.path=" + str(digits_dataset_dir),
            "run.root=" + str(tmp_path / "runs"),
            "model.autocast_dtype=bfloat16",
        ]

    def test_train_refuses_before_any_work(self, fake_cpu, tiny_model_dir, digits_dataset_dir, tmp_path):
        fake_cpu("AVX2", kernels=False)
        cfg = load_config(None, self._overrides(tiny_model_dir, digits_dataset_dir, tmp_path))
        problems = static_problems(cfg)
        assert len(problems) == 1 and problems[0].startswith("model.autocast_dtype=bfloat16 ")
        assert "AVX2" in problems[0] and "--set model.autocast_dtype=null" in problems[0]
        assert not (tmp_path / "runs").exists()
        fake_cpu("AVX512", kernels=True)
        assert static_problems(cfg) == []

    def test_stages_all_on_pools_are_not_judged_here(self, fake_cpu, tiny_model_dir, digits_dataset_dir, tmp_path):
        fake_cpu("AVX2", kernels=False)
        overrides = self._overrides(tiny_model_dir, digits_dataset_dir, tmp_path)
        pools = "{rollout: ppo-rollout/a, score: ppo-score/b, update: ppo-update/c}"
        assert precision_problem(load_config(None, overrides + ["pipeline.stage_pools=" + pools]))  # eval is local
        pools = pools[:-1] + ", eval: ppo-eval/d}"
        assert precision_problem(load_config(None, overrides + ["pipeline.stage_pools=" + pools])) is None

    def test_train_rm_refuses_before_any_work(self, fake_cpu, tiny_model_dir, digits_dataset_dir, tmp_path):
        from flows.rm_training import rm_training

        fake_cpu("AVX2", kernels=False)
        cfg = load_config(None, self._overrides(tiny_model_dir, digits_dataset_dir, tmp_path))
        with pytest.raises(PreflightError, match=r"cannot start \(1 problem\):\n  model.autocast_dtype=bfloat16 "):
            rm_training.fn(cfg.model_dump(mode="json"))  # the flow's body, without Prefect
        assert not (tmp_path / "runs").exists()
