"""The toy builders' shared command line (engines/toy/cli.py): flags become the builder's keywords, a flag left
out leaves the builder's own default, and the built path is printed."""

import json

import pytest

from engines.toy import preferences
from engines.toy.cli import toy_main


def test_flags_map_to_keywords_and_absent_flags_keep_the_builders_defaults(capsys):
    calls = []

    def build(out, count=7, seed=0):
        calls.append((out, count, seed))
        return f"{out}/built"

    toy_main("doc", build, {"--count": "count", "--seed": "seed"}, ["somewhere", "--seed", "3"])
    toy_main("doc", build, {"--count": "count", "--seed": "seed"}, ["elsewhere", "--count", "2"])
    assert calls == [("somewhere", 7, 3), ("elsewhere", 2, 0)]
    assert capsys.readouterr().out.splitlines() == ["somewhere/built", "elsewhere/built"]


def test_a_flag_must_be_an_integer():
    with pytest.raises(SystemExit):
        toy_main("doc", lambda out, seed=0: out, {"--seed": "seed"}, ["x", "--seed", "three"])


def test_preferences_command_writes_the_asked_number_of_pairs(tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    preferences.main([str(out), "--pairs", "5", "--seed", "1"])
    assert capsys.readouterr().out.strip() == str(out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5
    assert rows == preferences.make_pairs(5, 1)  # the same pairs the builder makes for that seed
    assert rows != preferences.make_pairs(5, 0)  # so the seed reached the builder
