"""Multi-turn eval (rollout.environment with eval.data_path): the eval stage plays every held-out row through the
environment with HF generate on the tiny model, against tests/fixtures/digit_env.py's scripted environments.

Checked against things derived here: the metrics of a hand-made table by hand; the eval shards against the same rows
played by the rollout driver directly (a second path: starts rendered here by hand, eval's settings and seeds);
every conversation's environment reward and success re-derived from the shards' columns (read with pyarrow alone)
by DigitGuessEnv's rule; the stage's metrics recomputed from those columns; a broken environment named as rollout
names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest

from engines.environments.checked import EnvironmentFailed
from engines.evaluation import pass_at_k
from stages.evaluate import per_data_source, run_eval
from stages.evaluate_multi_turn import multi_turn_eval_metrics

ENV = "tests.fixtures.digit_env:"
EVAL_ROWS = [  # (prompt, secret, data_source): in the tiny model's words
    ("say 7 :", "7", "left"),
    ("repeat 3 :", "3", "right"),
    ("write the digit 0 :", "0", "left"),
    ("copy number 5 :", "5", "right"),
]


def _table(rows: list[tuple]) -> pa.Table:
    names = ["reward", "env_reward", "turns", "truncation", "env_info", "data_source"]
    return pa.table({name: [row[i] for row in rows] for i, name in enumerate(names)})


def test_metrics_of_a_hand_made_table_by_hand():
    ok, no = {"is_success": True}, {"is_success": False}
    table = _table(
        [  # two held-out rows ("a", "b"), n = 2 conversations each
            (1.0, 1.0, 1, None, json.dumps([ok]), "a"),
            (0.5, 0.9, 2, None, json.dumps([no, ok]), "a"),
            (0.0, -0.2, 3, "max_turns", json.dumps([no, no, no]), "b"),
            (0.25, 0.0, 2, "max_total_tokens", json.dumps([no, {}]), "b"),  # its last step says nothing: a failure
        ]
    )
    metrics = multi_turn_eval_metrics(table, 2)
    # rewards 1 + .5 + 0 + .25 = 1.75; env 1 + .9 - .2 + 0 = 1.7; successes 2 of 4, row a 2 of 2, row b 0 of 2;
    # pass@2: a at least one success of 2 -> 1, b -> 0; turns 8 / 4; truncated 2 / 4.
    assert metrics == pytest.approx(
        {
            "eval/reward_mean": 0.4375,
            "eval/env_reward_mean": 0.425,
            "eval/accuracy": 0.5,
            "eval/pass@1": 0.5,
            "eval/pass@2": 0.5,
            "eval/turns_mean": 2.0,
            "eval/truncated_fraction": 0.5,
        }
    )
    by_source = per_data_source(multi_turn_eval_metrics, table, 2)
    assert by_source["eval/a/accuracy"] == 1.0 and by_source["eval/b/accuracy"] == 0.0
    assert by_source["eval/a/turns_mean"] == 1.5 and by_source["eval/b/truncated_fraction"] == 1.0
    assert by_source["eval/b/env_reward_mean"] == pytest.approx(-0.1)
    assert len(by_source) == 2 * len(metrics)
    # one data source: nothing per source (it would repeat the overall figures)
    assert per_data_source(multi_turn_eval_metrics, table.slice(0, 2), 2) == {}


def test_no_success_key_no_accuracy():
    table = _table([(1.0, 1.0, 1, None, json.dumps([{"step": 1}]), None), (0.0, 0.0, 1, None, "[]", None)])
    metrics = multi_turn_eval_metrics(table, 1)
    assert not any(k.startswith(("eval/accuracy", "eval/pass@")) for k in metrics)
    assert metrics["eval/env_reward_mean"] == 0.5


def _eval_set(path: Path) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "label": s, "data_source": d}) + "\n" for p, s, d in EVAL_ROWS))
    return str(path)


def _config(tmp_path, tiny_model_dir, digits_dataset_dir, env="SuccessDigitGuessEnv", rollout=(), **eval_settings):
    from engines.toy.run_config import toy_config

    sections = {
        "model": {"apply_chat_template": True},
        "data": {"max_prompt_tokens": 16},
        "rollout": {
            "engine": "hf",
            "n_samples": 2,
            "max_new_tokens": 4,
            # max_turns 2 < DigitGuessEnv's GIVE_UP 3: a policy that misses twice is cut by the limit (a truncation)
            "environment": {"source": ENV + env, "max_turns": 2, "max_total_tokens": 48},
            **dict(rollout),
        },
        "reward": {"sources": [{"kind": "environment"}]},
        "eval": {"data_path": _eval_set(tmp_path / "held_out.jsonl"), "n_samples": 2, **eval_settings},
    }
    return toy_config(tmp_path / "runs", "mt-eval", tiny_model_dir, digits_dataset_dir, seed=3, sections=sections)


def eval_rows(cfg, iteration: int) -> list[dict]:
    """Iteration `iteration`'s eval shards as a person reads them: every part with pyarrow alone, in part order;
    they are multi-turn shards (schema version 2)."""
    from storage.layout import layout_for

    layout = layout_for(cfg)
    parts = sorted(Path(layout.url(layout.stage_dir(iteration, "eval"))).glob("part-*.arrow"))
    tables = [pyarrow.ipc.open_file(str(p)).read_all() for p in parts]
    assert parts and all(t.schema.metadata[b"ppoflow.schema_version"] == b"2" for t in tables)
    return pa.concat_tables(tables).to_pylist()


def assert_rows_are_the_drivers(rows: list[dict], engine, tok, cfg) -> None:
    """The second path: the rollout driver itself on `engine`, from starts rendered here by the tiny template
    ("{role} : {content} "), with eval's sampling settings and row seeds: the eval rows are its conversations."""
    from engines.environments.loader import load_environment_factory
    from engines.rollout.multi_turn import ConversationStart, TurnLimits, run_conversations
    from stages.evaluate import eval_sampling, eval_sampling_seed

    starts = []
    for index, (prompt, secret, source) in enumerate(EVAL_ROWS):
        text = f"user : {prompt} assistant : "
        row = {"prompt": prompt, "label": secret, "data_source": source, "index": index}
        ids = tok(text, add_special_tokens=False)["input_ids"]
        starts.append(ConversationStart(index, row, prompt, text, ids, eval_sampling_seed(cfg.run.seed, index)))
    factory = load_environment_factory(cfg.rollout.environment.source)
    direct = run_conversations(engine, tok, factory, starts, eval_sampling(cfg), TurnLimits(2, 48))
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(s.prompt_index, s.sample_index) for s in direct]
    for row, sample in zip(rows, direct):
        assert row["prompt_ids"] == starts[sample.prompt_index].prompt_ids
        assert (row["response_ids"], row["token_owner"]) == (sample.response_ids, sample.token_owner)
        assert (row["turns"], row["truncation"]) == (sample.turns, sample.truncation)
        assert row["env_reward"] == pytest.approx(sample.env_reward)


def _replies(row: dict, tokenizer) -> list[list[str]]:
    """The words of each policy turn of a shard row, cut at turn_starts, owner 1."""
    bounds = row["turn_starts"] + [len(row["response_ids"])]
    spans = [(row["token_owner"][a], row["response_ids"][a:b]) for a, b in zip(bounds, bounds[1:])]
    return [tokenizer.decode(ids, skip_special_tokens=True).split() for owner, ids in spans if owner == 1]


def _by_hand(row: dict, tokenizer) -> tuple[float, bool, int]:
    """(env reward, success, turns) by DigitGuessEnv's rule: a reply holding the secret ends it with +1, a miss
    costs 0.1 and the environment asks again; max_turns = 2 cuts it after two misses."""
    reward, won, replies = 0.0, False, _replies(row, tokenizer)
    for words in replies:
        if row["label"] in words:
            reward, won = reward + 1.0, True
            break
        reward -= 0.1
    return reward, won, len(replies)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eval_plays_the_held_out_rows_as_the_driver_does(tmp_path, tiny_model_dir, digits_dataset_dir, temperature):
    from engines.models import load_tokenizer
    from engines.rollout.hf import HFRolloutEngine
    from stages.policy import initial_policy_ref

    cfg = _config(tmp_path, tiny_model_dir, digits_dataset_dir, temperature=temperature)
    manifest = run_eval(cfg, 0, initial_policy_ref(cfg))
    rows = eval_rows(cfg, 0)
    assert manifest.rows == len(rows) == 2 * len(EVAL_ROWS)

    tok = load_tokenizer(str(tiny_model_dir))
    assert_rows_are_the_drivers(rows, HFRolloutEngine(str(tiny_model_dir), seed=0, max_batch_size=8), tok, cfg)

    # Each conversation's reward and success by the environment's rule, from the shard's columns alone.
    hand = [_by_hand(row, tok) for row in rows]
    for row, (reward, won, turns) in zip(rows, hand):
        assert row["env_reward"] == pytest.approx(reward) and row["reward"] == pytest.approx(reward)
        assert json.loads(row["env_info"])[-1]["is_success"] is won and row["turns"] == turns
        assert (row["truncation"] == "max_turns") == (not won and turns == 2)
    if temperature == 0.0:  # greedy: a row's samples are one conversation
        assert all(rows[i]["response_ids"] == rows[i + 1]["response_ids"] for i in range(0, len(rows), 2))

    # The metrics, from the columns (the shards' order: row by row, 2 samples each).
    n, won = 2, [w for _, w, _ in hand]
    want = {
        "eval/reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "eval/env_reward_mean": sum(r for r, _, _ in hand) / len(rows),
        "eval/accuracy": sum(won) / len(rows),
        "eval/pass@1": sum(won) / len(rows),
        "eval/pass@2": sum(pass_at_k(n, sum(won[i : i + n]), n) for i in range(0, len(won), n)) / len(EVAL_ROWS),
        "eval/turns_mean": sum(t for _, _, t in hand) / len(rows),
        "eval/truncated_fraction": sum(r["truncation"] is not None for r in rows) / len(rows),
    }
    for source in ("left", "right"):
        mine = [i for i, r in enumerate(rows) if r["data_source"] == source]
        want[f"eval/{source}/accuracy"] = sum(won[i] for i in mine) / len(mine)
        want[f"eval/{source}/turns_mean"] = sum(hand[i][2] for i in mine) / len(mine)
    assert {k: v for k, v in manifest.metrics.items() if k in want} == pytest.approx(want, abs=1e-6)
    assert len(manifest.metrics) == 3 * 7  # the overall figures, and each per data source


def test_an_environment_without_success_gets_no_accuracy(tmp_path, tiny_model_dir, digits_dataset_dir):
    from stages.policy import initial_policy_ref

    cfg = _config(tmp_path, tiny_model_dir, digits_dataset_dir, env="DigitGuessEnv")
    metrics = run_eval(cfg, 0, initial_policy_ref(cfg)).metrics
    assert "eval/turns_mean" in metrics and not any("accuracy" in k or "pass@" in k for k in metrics)


@pytest.mark.parametrize(
    "env, what",
    [
        ("WrongTypeEnv", r"turn 1: step returned dict \{'text': 'now', 'reward': 1.0\}: expected an"),
        ("BadSuccessEnv", r"turn 1: step returned an Observation with info\['is_success'\] int 1: expected a bool"),
    ],
)
def test_a_broken_environment_is_named_as_the_rollout_names_it(tmp_path, tiny_model_dir, digits_dataset_dir, env, what):
    """The eval's message is the rollout's: the environment, the (held-out) row, the sample and the turn."""
    from stages.policy import initial_policy_ref
    from stages.rollout import run_rollout

    cfg = _config(tmp_path, tiny_model_dir, digits_dataset_dir, env=env)
    with pytest.raises(EnvironmentFailed, match=rf"^environment '{ENV}{env}' \(row 0, sample 0\) {what}"):
        run_eval(cfg, 0, initial_policy_ref(cfg))
    # the rollout drops a failed sample's group (stages/env_failures.py): all groups failing fail it, naming the first
    first = rf"first error: environment '{ENV}{env}' \(row \d+, sample 0\) {what}"
    with pytest.raises(
        EnvironmentFailed, match=rf"^rollout: environment '{ENV}{env}' failed in (\d+) of \1 groups .*{first}"
    ):
        run_rollout(cfg, 1, initial_policy_ref(cfg))


def test_the_guess_recipe_evaluates_before_and_after_training():
    """configs/multi_turn_guess_number.yaml loads, and its eval is the before / after of the README: the initial
    policy and the last iteration only, on every secret (the --every-secret set), several games each."""
    from ppoflow.config import load_config

    configs = Path(__file__).parents[2] / "configs"
    cfg = load_config(str(configs / "multi_turn_guess_number.yaml"))
    assert cfg.rollout.environment is not None and cfg.eval.before_training
    assert cfg.eval.every == cfg.run.iterations and cfg.eval.n_samples > 1 and cfg.eval.temperature > 0
    assert cfg.eval.data_path.endswith("guess-number-eval.jsonl")
    # the information-credit variant differs in its name and its environment only, so its eval rows compare
    variant = load_config(str(configs / "multi_turn_guess_number_information.yaml")).model_dump(mode="json")
    variant["run"]["name"] = cfg.run.name
    variant["rollout"]["environment"]["source"] = cfg.rollout.environment.source
    assert variant == cfg.model_dump(mode="json")
