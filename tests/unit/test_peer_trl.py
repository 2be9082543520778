"""The peer benchmark's harness (bench/peer_trl.py) and the TRL-side reward rule; no TRL training here.

The rule is checked against engines.toy.task.digit_reward on hand-built responses, the harness on
hand-written progress records whose aggregates are worked out in the comments.
"""

import json
import sys
from pathlib import Path

import pytest

from bench.peer_trl import SIZES, Trainer, alternating_schedule, headline, parse_records, run_one, summarize_trainer
from bench.trl_side.common import response_reward
from engines.toy.model import build_tokenizer
from engines.toy.task import digit_reward


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(64)


class TestAlternatingSchedule:
    def test_every_trainer_once_per_seed_in_the_same_order(self):
        assert alternating_schedule(["A", "B"], [0, 1, 2]) == [
            (0, "A"),
            (0, "B"),
            (1, "A"),
            (1, "B"),
            (2, "A"),
            (2, "B"),
        ]

    def test_never_the_same_trainer_twice_in_a_row(self):
        order = [name for _, name in alternating_schedule(["A", "B", "C"], list(range(5)))]
        assert all(a != b for a, b in zip(order, order[1:]))

    def test_duplicate_or_empty_trainers_are_an_error(self):
        with pytest.raises(ValueError, match="distinct"):
            alternating_schedule(["A", "A"], [0])
        with pytest.raises(ValueError, match="non-empty"):
            alternating_schedule([], [0])


def _iteration(k: int, reward: float, iter_s: float, wall_s: float = 0.0) -> dict:
    return {"event": "iteration", "iteration": k, "reward_mean": reward, "wall_s": wall_s, "iter_s": iter_s}


class TestParseRecords:
    def test_keeps_records_and_skips_library_output(self):
        stdout = "\n".join(
            [
                "===training policy===",
                "{'loss': 0.1}",  # a python dict repr, as HF's PrinterCallback prints: not JSON
                json.dumps(_iteration(1, 0.5, 2.0)),
                json.dumps({"loss": 0.3}),  # JSON without "event": someone else's line
                json.dumps([1, 2]),
                json.dumps({"event": "final", "train_s": 2.0}),
            ]
        )
        iterations, final = parse_records(stdout)
        assert iterations == [_iteration(1, 0.5, 2.0)]
        assert final == {"event": "final", "train_s": 2.0}

    def test_no_final_line_gives_none(self):
        assert parse_records(json.dumps(_iteration(1, 0.0, 1.0))) == ([_iteration(1, 0.0, 1.0)], None)


def _run(seed: int, rewards: list, iter_s: list, train_s: float, ok: bool = True) -> dict:
    walls = [sum(iter_s[: k + 1]) for k in range(len(iter_s))]
    its = [_iteration(k + 1, r, s, w) for k, (r, s, w) in enumerate(zip(rewards, iter_s, walls))]
    final = {"event": "final", "train_s": train_s, "setup_s": 1.0, "greedy_reward": None, "greedy_exact": None}
    return {
        "trainer": "t",
        "seed": seed,
        "ok": ok,
        "iterations": its if ok else [],
        "final": final if ok else None,
        **({} if ok else {"error": "rc 1: boom"}),
    }


class TestSummarizeTrainer:
    def test_means_over_seeds(self):
        runs = [
            _run(0, [0.1, 0.2, 0.4], [5.0, 2.0, 4.0], train_s=12.0),
            _run(1, [0.0, 0.3, 0.6], [7.0, 3.0, 3.0], train_s=14.0),
        ]
        s = summarize_trainer(runs, iterations=3)
        # iter_s: last wall (5+2+4, 7+3+3) / 3 -> (11/3 + 13/3) / 2 = 4.0, not train_s / 3 (what follows
        # the loop is no iteration's cost); steady: median(2, 4) = 3, median(3, 3) = 3 -> 3.0
        assert s["iter_s"] == pytest.approx(4.0)
        assert s["train_s"] == pytest.approx(13.0)
        assert s["iter_s_steady"] == pytest.approx(3.0)
        # reward at iteration 3: (0.4 + 0.6) / 2; last10 = mean of each run's mean: (0.7/3 + 0.9/3) / 2
        assert s["reward_at_3"] == pytest.approx(0.5)
        assert s["reward_last10"] == pytest.approx(1.6 / 6)
        assert s["greedy_reward"] is None
        assert (s["runs_ok"], s["runs"]) == (2, 2)

    def test_a_failed_run_is_counted_and_left_out(self):
        runs = [_run(0, [0.2, 0.4], [1.0, 1.0], train_s=2.0), _run(1, [], [], 0.0, ok=False)]
        s = summarize_trainer(runs, iterations=2)
        assert (s["runs_ok"], s["runs"]) == (1, 2)
        assert s["iter_s"] == pytest.approx(1.0)
        assert "boom" in s["errors"][0]

    def test_a_run_that_stopped_early_has_no_reward_at_the_last_iteration(self):
        s = summarize_trainer([_run(0, [0.2], [1.0], train_s=1.0)], iterations=2)
        assert s["reward_at_2"] is None


class TestHeadline:
    def test_ratios_are_ppoflow_over_trl_frozen(self):
        summaries = {
            "ppoflow_pipeline": {"iter_s": 12.0, "iter_s_steady": 2.0, "reward_at_3": 0.9},
            "ppoflow_engine": {"iter_s": 10.0, "iter_s_steady": 1.0, "reward_at_3": 0.8},
            "trl_ppo_frozen": {"iter_s": 8.0, "iter_s_steady": 8.0, "reward_at_3": 0.5},
            "trl_ppo_shipped": {"iter_s": 12.0, "iter_s_steady": 12.0},
            "trl_ppo_bf16": {"iter_s": 5.0, "iter_s_steady": 4.0, "reward_at_3": 0.4},
        }
        f = headline(summaries, 3, {})
        # at equal precision (TRL with bf16 autocast): 2/4 and 1/4; TRL's own bf16 gain 8/4
        assert f["ratio_same_precision"] == pytest.approx(0.5) and f["engine_ratio_same_precision"] == pytest.approx(
            0.25
        )
        assert f["trl_bf16_speedup"] == pytest.approx(2.0) and f["trl_bf16_reward_at_3"] == 0.4
        # steady state: 2/8 and 1/8; with the first iteration (engine start-up): 12/8 and 10/8
        assert f["ratio"] == pytest.approx(0.25) and f["engine_ratio"] == pytest.approx(0.125)
        assert f["ratio_with_first"] == pytest.approx(1.5) and f["engine_ratio_with_first"] == pytest.approx(1.25)
        assert f["trl_gc_speedup"] == pytest.approx(1.5)
        assert (f["ppoflow_reward_at_3"], f["trl_reward_at_3"]) == (0.9, 0.5)
        assert f["grpo_ratio"] is None  # no GRPO trainer ran

    def test_an_unavailable_trainer_is_named_with_its_reason(self):
        f = headline(
            {"trl_ppo_frozen": {"iter_s": 8.0, "iter_s_steady": 8.0}}, 3, {"ppoflow_pipeline": "not available: no flow"}
        )
        assert f["ratio"] is None and f["ppoflow_pipeline"] == "not available: no flow"


class TestRunOne:
    def test_collects_the_records_of_a_real_process(self):
        script = (
            "import json,os;"
            "print('library noise');"
            "print(json.dumps({'event':'iteration','iteration':1,'reward_mean':0.25,'wall_s':0.1,'iter_s':0.1}));"
            "print(json.dumps({'event':'final','train_s':0.1,'threads':os.environ['OMP_NUM_THREADS']}))"
        )
        trainer = Trainer("fake", "ppo", lambda m, s, i, g: [sys.executable, "-c", script])
        result = run_one(trainer, SIZES["small"], Path("."), seed=0)
        assert result["ok"], result.get("error")
        assert result["iterations"][0]["reward_mean"] == 0.25
        assert result["final"]["threads"] == "1"  # each process is held to one thread

    def test_a_failing_process_reports_its_stderr(self):
        trainer = Trainer("fake", "ppo", lambda m, s, i, g: [sys.executable, "-c", "raise SystemExit('broken rule')"])
        result = run_one(trainer, SIZES["small"], Path("."), seed=0)
        assert not result["ok"] and "broken rule" in result["error"]


class TestResponseReward:
    """The TRL-side rule on token ids must give digit_reward's value on the decoded words."""

    def test_matches_digit_reward_on_text(self, tokenizer):
        ids = tokenizer("3 3 say 3 w5 3 3 7", add_special_tokens=False)["input_ids"]
        # 5 of the 8 words are "3": 5/8, the same as the text rule
        assert response_reward(ids, "3", tokenizer, (tokenizer.eos_token_id, tokenizer.pad_token_id)) == 5 / 8
        assert digit_reward("3 3 say 3 w5 3 3 7", "3") == 5 / 8

    @pytest.mark.parametrize("end", ["eos", "pad"])
    def test_the_response_ends_at_eos_or_pad(self, tokenizer, end):
        end_id = tokenizer.eos_token_id if end == "eos" else tokenizer.pad_token_id
        ids = (
            tokenizer("3 3", add_special_tokens=False)["input_ids"]
            + [end_id]
            + [tokenizer.convert_tokens_to_ids("3")] * 5
        )
        # only the two words before the end count, over the 8-word target: 2/8
        assert response_reward(ids, "3", tokenizer, (tokenizer.eos_token_id, tokenizer.pad_token_id)) == 2 / 8


class TestDigitsRuleReward:
    """The reward *model* TRL's PPOTrainer gets: get_reward reads model.score(backbone(...).hidden_states[-1])."""

    def test_rows_of_prompt_and_response_get_the_digits_reward(self, tokenizer):
        import torch

        from bench.trl_side.ppo_trl import _rule_backbone_class

        prompts, labels = ["repeat 3 :", "write the digit 7 :"], ["3", "7"]
        rule = _rule_backbone_class()(tokenizer, prompts, labels)
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        short = tokenizer("repeat 3 :")["input_ids"]  # 4 ids with BOS; the other prompt has 6
        long = tokenizer("write the digit 7 :")["input_ids"]
        three, seven = tokenizer.convert_tokens_to_ids("3"), tokenizer.convert_tokens_to_ids("7")
        rows = torch.tensor(
            [
                [pad, pad] + short + [three, three, three, eos, pad],  # left-padded; 3 hits then EOS: 3/8
                long + [seven, pad, seven, seven, seven],  # a sampled pad ends it (TRL's view): 1/8
            ]
        )
        mask = rows != pad
        hidden = getattr(rule, rule.base_model_prefix)(input_ids=rows, attention_mask=mask).hidden_states[-1]
        scores = rule.score(hidden)
        assert scores.shape == (2, rows.shape[1], 1)
        assert scores[:, -1, 0].tolist() == [3 / 8, 1 / 8]
        assert torch.all(scores == scores[:, :1])  # the same value at every position TRL may read

    def test_an_unknown_prompt_is_an_error_naming_the_row(self, tokenizer):
        import torch

        from bench.trl_side.ppo_trl import _rule_backbone_class

        rule = _rule_backbone_class()(tokenizer, ["repeat 3 :"], ["3"])
        rows = torch.tensor([tokenizer("say 4 : 4 4")["input_ids"]])
        with pytest.raises(ValueError, match="row 0"):
            rule.rule(input_ids=rows, attention_mask=torch.ones_like(rows))


class TestMeanCurves:
    def test_mean_over_seeds_up_to_the_shortest_run_and_failed_runs_left_out(self):
        from bench.plots import mean_curves

        def it(k, r, w):
            return {"iteration": k, "reward_mean": r, "wall_s": w}

        curves = {
            "runs": [
                {
                    "trainer": "a",
                    "seed": 0,
                    "ok": True,
                    "iterations": [it(1, 0.0, 1.0), it(2, 0.5, 2.0), it(3, 1.0, 3.0)],
                },
                {"trainer": "a", "seed": 1, "ok": True, "iterations": [it(1, 0.2, 3.0), it(2, 0.1, 4.0)]},
                {"trainer": "a", "seed": 2, "ok": False, "iterations": [it(1, 9.0, 9.0)]},
            ]
        }
        # two good runs, cut to 2 iterations: rewards (0+0.2)/2, (0.5+0.1)/2; seconds (1+3)/2, (2+4)/2
        got = mean_curves(curves)["a"]
        assert got["iteration"] == [1, 2]
        assert got["reward"] == pytest.approx([0.1, 0.3])
        assert got["seconds"] == pytest.approx([2.0, 3.0])


class TestRecipeMirror:
    """ppoflow's config for the benchmark must validate and hold the numbers the TRL scripts use."""

    def test_ppo_recipe(self):
        from bench.ppoflow_side import recipe_overrides
        from bench.trl_side import ppo_trl
        from ppoflow.config import load_config

        cfg = load_config(None, recipe_overrides("ppo", pad_token_id=0))
        assert cfg.rollout.prompts_per_iteration == ppo_trl.PROMPTS_PER_ITERATION and cfg.rollout.n_samples == 1
        assert cfg.rollout.max_new_tokens == ppo_trl.RESPONSE_LENGTH
        assert cfg.rollout.stop_token_ids == [0]  # TRL ends a response at a sampled pad too
        assert (cfg.train.ppo_epochs, cfg.train.train_batch_size, cfg.train.max_grad_norm) == (4, 64, None)
        assert (cfg.train.actor_lr, cfg.train.critic_lr, cfg.train.lr_schedule) == (1e-3, 1e-3, "constant")
        a = cfg.algo
        assert (a.name, a.kl_coef, a.kl_estimator, a.kl_in_reward, a.kl_target) == ("ppo", 0.05, "k1", True, None)
        assert (a.gamma, a.lam, a.clip_low, a.clip_high, a.value_clip) == (1.0, 0.95, 0.2, 0.2, 0.2)
        assert a.whiten_advantages

    def test_grpo_recipe(self):
        from bench.ppoflow_side import recipe_overrides
        from bench.trl_side import grpo_trl
        from ppoflow.config import load_config

        cfg = load_config(None, recipe_overrides("grpo", pad_token_id=0))
        assert (cfg.rollout.prompts_per_iteration, cfg.rollout.n_samples) == (
            grpo_trl.PROMPTS_PER_ITERATION,
            grpo_trl.SAMPLES_PER_PROMPT,
        )
        assert (cfg.algo.name, cfg.algo.kl_estimator, cfg.algo.kl_in_reward, cfg.train.ppo_epochs) == (
            "grpo",
            "k3",
            False,
            1,
        )
        assert not cfg.algo.whiten_advantages  # TRL GRPO normalises within groups only

    def test_unknown_algo_is_an_error(self):
        from bench.ppoflow_side import recipe_overrides

        with pytest.raises(ValueError, match="unknown algo 'dpo'"):
            recipe_overrides("dpo", 0)


class TestRunEngineLoop:
    """The harness around stages/loop.py's EngineLoop (the real loop runs in the benchmark, not here)."""

    class _Loop:
        def __init__(self, rewards, fail_at=None):
            from types import SimpleNamespace

            self.cfg = SimpleNamespace(run=SimpleNamespace(iterations=len(rewards)))
            self.rewards, self.fail_at, self.shut = rewards, fail_at, False

        def run_iteration(self, iteration):
            if iteration == self.fail_at:
                raise RuntimeError("update failed")
            return {"reward/mean": self.rewards[iteration - 1], "kl/mean": 0.0}

        def shutdown(self):
            self.shut = True

    def test_one_record_per_iteration_then_shutdown(self, capsys):
        from bench.ppoflow_side import run_engine_loop
        from bench.trl_side.common import Stopwatch

        loop, records = self._Loop([0.1, 0.4]), []
        run_engine_loop(loop, Stopwatch(), records)
        assert [(r["iteration"], r["reward_mean"]) for r in records] == [(1, 0.1), (2, 0.4)]
        assert parse_records(capsys.readouterr().out)[0] == records  # what the orchestrator will read
        assert loop.shut

    def test_the_engine_is_shut_down_when_an_iteration_fails(self):
        from bench.ppoflow_side import run_engine_loop
        from bench.trl_side.common import Stopwatch

        loop = self._Loop([0.1, 0.4], fail_at=2)
        with pytest.raises(RuntimeError, match="update failed"):
            run_engine_loop(loop, Stopwatch(), [])
        assert loop.shut


def test_pipeline_runs_get_an_empty_prefect_home_unless_a_server_is_configured(tmp_path, monkeypatch):
    import os

    from bench.ppoflow_side import fresh_prefect_home

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "shared-home"))
    first, second = fresh_prefect_home(tmp_path / "w"), fresh_prefect_home(tmp_path / "w")
    assert first != second and first.parent == second.parent == tmp_path / "w"
    assert list(first.iterdir()) == [] and os.environ["PREFECT_HOME"] == str(second)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert fresh_prefect_home(tmp_path / "w") is None and os.environ["PREFECT_HOME"] == str(second)
