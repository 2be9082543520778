"""bench/update_mfu.py: its FLOP counts against hand derivations and transformers' own parameter count, and
one CPU run of the real PPOTrainer update through it (no GPU here: MFU itself is measured only on one)."""

import pytest

import bench.update_mfu as mfu
from bench.update_mfu import ModelSize, layer_params, plain_step_flops, update_flops


class TestLayerParams:
    def test_matches_a_real_llama_decoder_layer(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        size = ModelSize(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=320, vocab_size=50)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=50,
                hidden_size=128,
                intermediate_size=320,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
            )
        )
        counted = sum(p.numel() for p in model.model.layers[0].parameters())
        assert layer_params(size) == counted

    def test_the_bench_sizes_by_hand(self):
        # 0.5b: 4*1024^2 + 3*1024*4096 + 2*1024 = 4,194,304 + 12,582,912 + 2,048
        assert layer_params(mfu.SIZES["0.5b"]) == 16_779_264


class TestUpdateFlops:
    # L=1, d=2, f=4, V=3: layer params 4*4 + 3*2*4 + 2*2 = 44. One row, prompt 2 + response 2: the input is
    # S = 2 + 2 - 1 = 3 columns, T = 3 tokens.
    # body = 6*44*3 + 12*1*2*3*3 - (the last layer's MLP skipped on the one prompt column: 6*3*2*4*1 = 144)
    #      = 792 + 216 - 144 = 864;  LM head over the 2 response columns = 6*2*3*2 = 72
    # one PPO epoch = actor (864 + 72) + critic 864 = 1800
    SIZE = ModelSize(hidden_size=2, num_layers=1, num_heads=1, intermediate_size=4, vocab_size=3)

    def test_epochs_reusing_the_first_forward(self):
        assert update_flops(self.SIZE, 1, 2, 2, epochs=2, old_from_first_forward=True) == 2 * 1800

    def test_a_separate_old_forward_adds_a_third_of_a_pass(self):
        assert update_flops(self.SIZE, 1, 2, 2, epochs=2, old_from_first_forward=False) == 2 * 1800 + 600

    def test_plain_step_runs_the_head_over_every_token(self):
        # S = T = 2, every column through every layer and the head: 6*44*2 + 12*2*2*2 + 6*2*3*2
        assert plain_step_flops(self.SIZE, 1, 2) == 528 + 96 + 72


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch, reuse", [(4, True), (2, False)])
def test_a_cpu_run_reports_consistent_figures(tmp_path, monkeypatch, micro_batch, reuse):
    """The real update runs; the figures agree with each other (tokens/s from seconds and shapes), and the
    first-forward reuse is reported exactly when one micro-batch holds the whole batch."""
    captured = {}
    monkeypatch.setattr(mfu, "emit", lambda name, figures: captured.update(figures) or figures)
    monkeypatch.setitem(
        mfu.SIZES, "test", ModelSize(hidden_size=128, num_layers=1, num_heads=2, intermediate_size=256, vocab_size=64)
    )
    mfu.main(
        [
            "--size",
            "test",
            "--device",
            "cpu",
            "--batch",
            "4",
            "--micro-batch",
            str(micro_batch),
            "--prompt-len",
            "6",
            "--response-len",
            "4",
            "--epochs",
            "2",
            "--updates",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    f = captured
    assert f["old_from_first_forward"] is reuse
    assert f["mfu"] is None and f["peak_mem_gib"] is None  # no peak and no GPU memory on CPU
    tokens = 4 * (6 + 4)
    # The bench rounds tokens/s to 0.1: a slow step prints 37.0 where the seconds give 36.95.
    assert f["update_tokens_per_s"] == pytest.approx(tokens * 2 / f["update_s"], rel=1e-3, abs=0.1)
    assert f["plain_tokens_per_s"] == pytest.approx(tokens / f["plain_step_s"], rel=1e-3, abs=0.1)
    expected = update_flops(mfu.SIZES["test"], 4, 6, 4, 2, reuse) / f["update_s"] / 1e12
    assert f["update_tflops"] == pytest.approx(expected, rel=1e-2, abs=1e-3)
