"""reasoning-gym as a data source (engines/reasoning_tasks.py) and its scorers as rewards
(engines/rewards/reasoning_tasks.py).

Expected values come from reasoning-gym itself (its generators called directly) or by hand from its scoring rule
(ProceduralDataset.score_answer: 1.0 for the answer, len(answer) / len(text) for a text that contains it).
"""

from __future__ import annotations

import json

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from engines.data import check_dataset  # noqa: E402
from engines.reasoning_tasks import generate_rows, materialize  # noqa: E402
from engines.rewards.function import FunctionRewardSource  # noqa: E402
from engines.rewards.reasoning_tasks import (  # noqa: E402
    score_answer_tag,
    score_digits,
    score_last_line,
    score_last_number,
    score_response,
)
from ppoflow.config import ConfigError, ReasoningGymConfig, load_config  # noqa: E402

TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _as_json(entry: dict) -> dict:
    return json.loads(json.dumps(entry))  # tuples in metadata become lists


def _spec(**kw) -> ReasoningGymConfig:
    return ReasoningGymConfig(**{"task": "chain_sum", "config": TWO_TERMS, "size": 50, "seed": 7, **kw})


class TestRows:
    def test_training_rows_are_the_tasks_own_entries(self):
        train, held = generate_rows(_spec(prompt_template="Q: {question}"))
        entries = list(reasoning_gym.create_dataset("chain_sum", seed=7, size=50, **TWO_TERMS))
        assert held == []
        assert [r["prompt"] for r in train] == ["Q: " + e["question"] for e in entries]
        assert [json.loads(r["label"]) for r in train] == [_as_json(e) for e in entries]
        assert {r["data_source"] for r in train} == {"chain_sum"}

    def test_held_out_rows_are_new_questions_from_another_seed(self):
        train, held = generate_rows(_spec(eval_size=30))
        assert len(held) == 30
        assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
        assert len({r["prompt"] for r in held}) == 30
        # eval_seed defaults to seed + size: entry 0 of the held-out draws is reasoning-gym's entry of seed 57
        first = next(iter(reasoning_gym.create_dataset("chain_sum", seed=57, size=1, **TWO_TERMS)))
        assert json.loads(held[0]["label"]) == _as_json(first)
        assert generate_rows(_spec(eval_size=30)) == (train, held)  # deterministic

    def test_a_task_space_too_small_for_the_held_out_set_is_refused(self):
        one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 questions in all
        with pytest.raises(ConfigError, match=r"data.reasoning_gym.*held-out questions"):
            generate_rows(_spec(config=one_digit, size=2000, eval_size=200))

    def test_unknown_task_and_bad_task_config_name_the_field(self):
        with pytest.raises(ConfigError, match=r"data.reasoning_gym.task = 'chain_summ'"):
            generate_rows(_spec(task="chain_summ"))
        with pytest.raises(ConfigError, match=r"data.reasoning_gym.config"):
            generate_rows(_spec(config={"min_terms": 2, "no_such_field": 1}))

    def test_the_prompt_template_must_hold_the_question(self):
        with pytest.raises(ConfigError, match=r"prompt_template.*must contain \{question\}"):
            load_config(None, ["data.reasoning_gym={task: chain_sum, prompt_template: 'Solve it'}"])


def test_materialize_writes_the_files_once_and_points_the_config_at_them(tmp_path):
    cfg = load_config(
        None,
        [
            f"run.root={tmp_path}",
            "data.reasoning_gym={task: chain_sum, size: 40, eval_size: 10, config: "
            "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}}",
        ],
    )
    done = materialize(cfg)
    train, held = done.data.path, done.eval.data_path
    assert train.startswith(str(tmp_path / "_data" / "reasoning-gym" / "chain_sum-"))
    assert (done.data.prompt_key, done.data.label_key, done.data.data_source_key) == ("prompt", "label", "data_source")
    assert check_dataset(done.data) == 40
    assert sum(1 for _ in open(held)) == 10
    stamp = (tmp_path / train).stat().st_mtime_ns
    again = materialize(cfg)
    assert (again.data.path, again.eval.data_path) == (train, held)
    assert (tmp_path / train).stat().st_mtime_ns == stamp  # reused, not rewritten
    assert materialize(load_config(None, [f"run.root={tmp_path}"])).data.path == "./runs/_data/digits"  # untouched


class TestScores:
    LABEL = json.dumps({"question": "What is 3 + 5?", "answer": "8", "metadata": {}})

    def test_whole_response(self):
        assert score_response("chain_sum", " 8\n", self.LABEL) == 1.0
        assert score_response("chain_sum", "3 + 5 = 8", self.LABEL) == pytest.approx(1 / 9)  # "8" in 9 characters
        assert score_response("chain_sum", "7", self.LABEL) == 0.0

    def test_extractions(self):
        assert score_last_number("chain_sum", "3 + 5 = 8", self.LABEL) == 1.0
        assert score_last_number("chain_sum", "no number", self.LABEL) == 0.0
        assert score_answer_tag("chain_sum", "so <answer> 8 </answer>", self.LABEL) == 1.0
        assert score_answer_tag("chain_sum", "8", self.LABEL) == 0.0  # no tag, no answer
        assert score_last_line("chain_sum", "3 + 5\n8\n\n", self.LABEL) == 1.0

    def test_digit_credit_counts_places_from_the_units_up(self):
        label = json.dumps({"question": "Calculate 6983 + 3172.", "answer": "10155", "metadata": {}})
        assert score_digits("basic_arithmetic", "6983 + 3172 = 10155", label) == 1.0
        assert score_digits("basic_arithmetic", "10154", label) == pytest.approx(4 / 5)  # units wrong
        assert score_digits("basic_arithmetic", "155", label) == pytest.approx(3 / 5)  # 1, 5, 5 right of 5 places
        assert score_digits("basic_arithmetic", "910155", label) == pytest.approx(5 / 6)  # one place too many
        assert score_digits("basic_arithmetic", "-10155", label) == 0.0  # wrong sign
        assert score_digits("basic_arithmetic", "01234", label) == 0.0  # 1234 against 10155: no place matches
        assert score_digits("basic_arithmetic", "no number", label) == 0.0

    def test_digit_credit_is_below_one_for_every_wrong_integer(self):
        # property: only the right integer scores 1.0, so eval/accuracy (rewards == 1.0) counts exact answers
        label = json.dumps({"question": "?", "answer": "307", "metadata": {}})
        scores = {n: score_digits("basic_arithmetic", str(n), label) for n in range(-50, 2000)}
        assert [n for n, s in scores.items() if s == 1.0] == [307]
        assert all(0.0 <= s < 1.0 for n, s in scores.items() if n != 307)

    def test_digit_credit_falls_back_to_the_tasks_scorer_off_integers(self):
        label = json.dumps({"question": "?", "answer": "2.5", "metadata": {}})
        assert score_digits("basic_arithmetic", "so 2.5", label) == 1.0
        assert score_digits("basic_arithmetic", "so 2.4", label) == 0.0

    def test_a_label_that_is_not_an_entry_names_the_task(self):
        with pytest.raises(ValueError, match="reasoning-gym task 'chain_sum': the label must be the task's entry"):
            score_response("chain_sum", "8", "8")

    def test_they_load_as_verl_contract_reward_functions(self):
        source = FunctionRewardSource("engines.rewards.reasoning_tasks:score_response")
        try:
            assert source.contract == "verl"
        finally:
            source.close()
