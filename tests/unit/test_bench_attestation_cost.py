"""bench/attestation_cost.py's pure helpers: per-iteration figures from metrics rows and rollout stage records."""

from __future__ import annotations

from bench.attestation_cost import per_iteration, summary


def test_per_iteration_figures_and_their_summary():
    rows = [
        {"iteration": 0, "eval/accuracy": 0.2},  # the initial eval's row: no rollout
        {"iteration": 1, "mismatch/logprob_abs_diff_mean": 2e-6, "mismatch/logprob_abs_diff_max": 1e-4},
        {"iteration": 2, "mismatch/logprob_abs_diff_mean": 4e-6, "mismatch/kl": 1e-9},
        {"iteration": 3},  # its record is missing: left out
    ]
    records = {
        1: {"seconds": 40.0, "attested": {"seconds": 0.4}},
        2: {"seconds": 50.0, "attested": None},  # not attested (tensor parallelism): no attest_* keys
    }
    entries = per_iteration(rows, records)
    assert entries == [
        # 0.4 / 40 = 0.01
        {"iteration": 1, "rollout_stage_s": 40.0, "attest_s": 0.4, "attest_share": 0.01, "gap_mean": 2e-6,
         "gap_max": 1e-4},
        {"iteration": 2, "rollout_stage_s": 50.0, "gap_mean": 4e-6, "kl": 1e-9},
    ]  # fmt: skip
    figures = summary(entries)
    assert figures["attest_share_median"] == figures["attest_share_max"] == 0.01  # one attested iteration
    assert figures["rollout_stage_s_median"] == 45.0 and figures["gap_mean_max"] == 4e-6
    assert figures["kl_median"] == 1e-9 and "attest_s_median" in figures
