"""bench.learning's summary of dynamic sampling's flat groups, on per-iteration figures written by hand."""

from bench.learning import flat_groups_trained


def test_flat_groups_summary_by_hand():
    # iterations 0-1 trained no flat group; 2 and 3 (reward 0.99, 1.0) trained a quarter and a half of theirs
    got = flat_groups_trained([(0, 0.0, 0.1), (1, 0.0, 0.5), (2, 0.25, 0.99), (3, 0.5, 1.0)])
    assert got == {
        "zero_variance_trained_fraction_mean": 0.1875,  # (0 + 0 + 0.25 + 0.5) / 4
        "zero_variance_trained_fraction_max": 0.5,
        "zero_variance_trained_first_iteration": 2,
        "zero_variance_trained_first_reward": 0.99,
    }


def test_never_topped_up_and_absent():
    got = flat_groups_trained([(0, 0.0, 0.2), (1, 0.0, 0.7)])
    assert got["zero_variance_trained_fraction_max"] == 0.0 and got["zero_variance_trained_first_iteration"] is None
    assert flat_groups_trained([]) == {}  # dynamic sampling off: the metric is absent, so is its summary
