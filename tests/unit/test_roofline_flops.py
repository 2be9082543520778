"""bench/roofline_flops.py: the modelled rollout FLOPs and the counted FLOPs of a real forward and backward,
each against a count by hand on shapes small enough to write out."""

from __future__ import annotations

import json

import pytest
import torch

from bench.roofline_flops import Dims, counted_flops, rollout_flops

# L=1, d=2, H=G=1, e=2, f=4, V=3:
#   layer_matmul = 2 x (q 2*2 + k,v 2*(2*2) + o 2*2 + gate/up/down 3*2*4) = 2 x 40 = 80
#   attention(k) = 4 * 1 * 1 * 2 * k = 8k;  head = 2 * 2 * 3 = 12
SMALL = Dims(layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=4, vocab=3)


class TestRolloutFlops:
    def test_the_parts_by_hand(self):
        assert (SMALL.layer_matmul, SMALL.attention(5), SMALL.head) == (80, 40, 12)

    def test_one_group_by_hand(self):
        # prompt of 2: prefill 2 * 80 + attention over 1 and 2 keys (8 + 16) = 184
        # sample of 2 tokens: head 2 * 12 = 24; one decode step (t = 1) over 2 + 1 keys: 80 + 24 = 104
        # sample of 0 tokens: nothing
        assert rollout_flops(SMALL, [(2, [2, 0])]) == 184 + 24 + 104

    def test_the_prompt_counts_once_per_group(self):
        one, two = rollout_flops(SMALL, [(3, [1])]), rollout_flops(SMALL, [(3, [1, 1])])
        assert two - one == SMALL.head  # the second sample adds only its one token's logits

    def test_bad_lengths_are_named(self):
        with pytest.raises(ValueError, match="0 tokens"):
            rollout_flops(SMALL, [(0, [1])])
        with pytest.raises(ValueError, match="-1 response tokens"):
            rollout_flops(SMALL, [(1, [-1])])


def test_dims_from_a_model_folder(tmp_path):
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 1536, "vocab_size": 49152}))
    assert Dims.from_model_dir(tmp_path) == Dims(30, 576, 9, 3, 64, 1536, 49152)  # SmolLM2-135M's shape


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config), Dims(1, 8, 2, 1, 4, 12, 10)


def test_a_real_forward_and_backward_counted_by_hand():
    """B = 2 rows of S = 5 tokens through a 1-layer Llama (hidden 8, 2 query heads and 1 key/value head of 4,
    MLP 12, vocabulary 10) on the CPU, with SDPA's CPU kernel, which torch's own counter leaves at 0. Forward:
      layers     T * layer_matmul = 10 * 2 * (q 8*8 + k,v 2*8*4 + o 8*8 + gate/up/down 3*8*12) = 10 * 960 = 9,600
      LM head    T * 2 d V = 10 * 2 * 8 * 10 = 1,600
      attention  4 B H S S e = 4 * 2 * 2 * 5 * 5 * 4 = 1,600
    = 12,800. Forward + backward: every one of them has a gradient to compute, twice the forward's work: x3."""
    model, dims = _tiny_llama()
    ids = torch.randint(0, 10, (2, 5))
    forward = 10 * dims.layer_matmul + 10 * dims.head + 4 * 2 * 2 * 5 * 5 * 4
    assert forward == 12_800
    _, counted = counted_flops(lambda: model(input_ids=ids).logits)
    assert counted == forward
    _, counted = counted_flops(lambda: model(input_ids=ids).logits.sum().backward())
    assert counted == 3 * forward


class TestRooflineFigures:
    def test_the_groups_of_a_rollout_table(self):
        import pyarrow as pa

        from bench.roofline import rollout_groups

        table = pa.table(
            {
                "prompt_ids": [[1, 2, 3], [1, 2, 3], [4, 5]],
                "response_ids": [[7], [7, 8], [9, 9, 9]],
                "sample_index": [0, 1, 0],
            }
        )
        assert rollout_groups(table) == [(3, [1, 2]), (2, [3])]

    def test_walls_from_the_iterations_ends(self):
        from bench.roofline import iteration_walls

        rows = [{"iteration": 0}] + [
            {"iteration": i, "time/finished_unix": 100.0 + t} for i, t in ((1, 30), (2, 40), (3, 52))
        ]
        # started at 100: iteration 1 ends 30 s in; then gaps of 10 and 12 s, median 11
        assert iteration_walls(rows, 100.0) == (30.0, 11.0)

    def test_ratios_by_hand(self):
        from bench.roofline import roofline

        flops = {"rollout": 2e9, "score": 1e9, "update": 3e9, "checkpoint": 0}
        seconds = {"timing/rollout": 4.0, "timing/score": 1.0, "timing/update": 6.0, "timing/checkpoint": 0.5}
        out = roofline(flops, seconds, wall=12.5, peak=1.0)  # 1 GFLOP/s: bound seconds = GFLOP
        assert out["rollout"] == {"gflop": 2.0, "bound_s": 2.0, "measured_s": 4.0, "ratio": 2.0}
        assert out["checkpoint"]["ratio"] is None  # no FLOPs: no bound to be a multiple of
        # 6 GFLOP against 12.5 s; 12.5 - (4 + 1 + 6 + 0.5) = 1 s outside the stages
        assert out["iteration"] == {"gflop": 6.0, "bound_s": 6.0, "measured_s": 12.5, "ratio": 2.08, "outside_s": 1.0}

    def test_the_update_split_into_its_ppo_update_and_its_checkpoint_save(self):
        from bench.roofline import roofline

        flops = {"rollout": 0, "score": 0, "update": 3e9, "checkpoint": 0}
        seconds = {"timing/update": 6.0, "timing/update_train": 4.5, "timing/update_save": 1.2}
        out = roofline(flops, seconds, wall=6.0, peak=1.0)["update"]
        # the update's 3 GFLOP are the PPO update's alone: 4.5 s against 3 s is 1.5x; the save has no bound
        assert (out["ratio"], out["train_s"], out["train_ratio"], out["save_s"]) == (2.0, 4.5, 1.5, 1.2)
        assert "train_s" not in roofline(flops, {"timing/update": 6.0}, wall=6.0, peak=1.0)["update"]  # older rows

    def test_the_rollout_split_into_serving_the_policy_and_sampling(self):
        from bench.roofline import roofline

        flops = {"rollout": 2e9, "score": 0, "update": 0, "checkpoint": 0}
        seconds = {"timing/rollout": 4.0, "timing/rollout_serve": 0.8, "timing/rollout_sample": 3.0}
        out = roofline(flops, seconds, wall=4.0, peak=0.5)["rollout"]
        # 2 GFLOP at 0.5 GFLOP/s: a 4 s bound; sampling took 3 s of it (0.75x), serving the policy 0.8 s (no bound)
        assert (out["bound_s"], out["ratio"], out["sample_s"], out["sample_ratio"], out["serve_s"]) == (
            4.0,
            1.0,
            3.0,
            0.75,
            0.8,
        )
        assert "sample_s" not in roofline(flops, {"timing/rollout": 4.0}, wall=4.0, peak=0.5)["rollout"]  # older rows

    def test_the_matmul_figures_by_hand(self):
        from bench.roofline import roofline

        flops = {"rollout": 2e9, "score": 0, "update": 3e9, "checkpoint": 0}
        seconds = {"timing/rollout": 4.0, "timing/update": 6.0}
        matmuls = {"update": {"matmul_s": 4.0, "profiled_s": 7.0}, "score": {"matmul_s": 1.0, "profiled_s": 2.0}}
        out = roofline(flops, seconds, wall=10.0, peak=1.0, matmuls=matmuls)
        # 3 GFLOP in 4 s of matmuls: 0.75 GFLOP/s, and 4 s against a 3 s bound is a floor of 1.33x
        assert {k: out["update"][k] for k in ("profiled_s", "matmul_s", "matmul_gflops", "matmul_floor_ratio")} == {
            "profiled_s": 7.0,
            "matmul_s": 4.0,
            "matmul_gflops": 0.8,
            "matmul_floor_ratio": 1.33,
        }
        assert "matmul_s" not in out["rollout"]  # not profiled (vLLM computes in its own process)
        assert "matmul_s" not in out["score"]  # no FLOPs: no bound to be a multiple of


class TestMatmulSplit:
    def test_a_pass_of_matrix_multiplies_is_mostly_matmul_time(self):
        from bench.roofline import matmul_split

        # 20 products of 512 x 512 (~5 GFLOP, ~50 ms here): large against the profiler's fixed cost per pass, which
        # outweighed 20 products of 256 x 256 (16 ms profiled, 6 ms of matmuls) after the rest of the unit suite
        a = torch.randn(512, 512)
        split = matmul_split(lambda: [a @ a for _ in range(20)])
        assert 0.5 * split["profiled_s"] < split["matmul_s"] <= split["profiled_s"]

    def test_a_pass_without_one_has_no_matmul_time(self):
        from bench.roofline import matmul_split

        a = torch.randn(256, 256)
        split = matmul_split(lambda: [a.exp() + a for _ in range(20)])
        assert split["matmul_s"] == 0 and split["profiled_s"] > 0
