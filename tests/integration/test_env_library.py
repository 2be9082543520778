"""SkyRL-Gym's own environments driven through ppoflow (load_environment_factory + CheckedEnvironment, the path the
rollout driver takes) by a scripted policy, against the same environments driven directly with skyrl_gym's own
API: the second implementation. Observations, per-turn rewards and done must agree turn by turn.

Two environments: gsm8k_multi_turn (a user turn back after each answer, per-turn rewards) and text2sql (a SQL
tool over a real sqlite file that this test writes, so it runs offline)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from engines.environments.checked import CheckedEnvironment, EnvironmentFailed
from engines.environments.loader import load_environment_factory

skyrl_gym = pytest.importorskip("skyrl_gym")
from omegaconf import OmegaConf  # noqa: E402  (after the skip: skyrl-gym brings omegaconf)

ADAPTER = "engines.environments.skyrl:SkyRLGymEnvironment"


def _through_ppoflow(spec: str, row: dict, replies: list[str]) -> tuple[str | None, list[tuple]]:
    """The rollout driver's loop (engines/environments/base.py) with fixed assistant replies."""
    env = CheckedEnvironment.start(load_environment_factory(spec), row_index=3, sample_index=0)
    try:
        first = env.reset(row)
        messages = [{"role": "user", "content": first or row["prompt"]}]
        turns = []
        for reply in replies:
            messages.append({"role": "assistant", "content": reply})
            obs = env.step(messages)
            turns.append((obs.role, obs.text, obs.reward, obs.done))
            if obs.done:
                break
            messages.append({"role": obs.role, "content": obs.text})
    finally:
        env.close()
    return first, turns


def _directly(env_class: str, env_config: dict, extras: dict, replies: list[str]) -> list[tuple]:
    """The same episode with skyrl_gym's API alone, as SkyRL's trainer drives it."""
    env = skyrl_gym.make(env_class, env_config=OmegaConf.create(env_config), extras=extras)
    env.init([{"role": "user", "content": extras["prompt"]}])
    turns = []
    for reply in replies:
        out = env.step(reply)
        text = "\n".join(m["content"] for m in out["observations"])
        role = out["observations"][0]["role"] if out["observations"] else "user"
        turns.append((role, text, float(out["reward"]), out["done"]))
        if out["done"]:
            break
    env.close()
    return turns


def test_gsm8k_multi_turn_agrees_with_skyrl_gym():
    row = {"prompt": "Tom has 40 apples and buys 2. How many?", "label": "42", "env_class": "gsm8k_multi_turn"}
    row["extra_info"] = {"max_turns": 3}
    replies = ["Let me think: 40 + 1 = 41. #### 41", "no format here", "#### 42", "never sent"]
    first, turns = _through_ppoflow(ADAPTER, row, replies)
    expected = _directly(
        "gsm8k_multi_turn", {}, dict(row, reward_spec={"method": "rule", "ground_truth": "42"}), replies
    )
    assert first is None and turns == expected
    # By hand: a formatted wrong answer earns the format score 0.2 / max_turns, an unformatted one 0, the right
    # one 1 and ends the episode at turn 3; turns 1 and 2 ask again as the user.
    assert [(t[2], t[3]) for t in turns] == [(pytest.approx(0.2 / 3), False), (0.0, False), (1.0, True)]
    assert turns[0][0] == "user" and "#### ANSWER" in turns[0][1]


def _shop_database(root) -> None:
    folder = root / "spider" / "database" / "shop"
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / "shop.sqlite") as db:
        db.execute("create table items (name text, price real)")
        db.executemany("insert into items values (?, ?)", [("pen", 1.5), ("book", 12.0), ("lamp", 30.0)])


def test_text2sql_tool_turns_agree_with_skyrl_gym(tmp_path):
    _shop_database(tmp_path)
    factory_file = tmp_path / "my_envs.py"
    factory_file.write_text(
        textwrap.dedent(f"""
        from engines.environments.skyrl import SkyRLGymEnvironment
        text2sql = SkyRLGymEnvironment.using("text2sql", db_path={str(tmp_path)!r})
    """)
    )
    gold = "SELECT name FROM items WHERE price > 10"
    row = {
        "prompt": "Which items cost more than 10? Query the shop database with <sql>...</sql>.",
        "db_id": "shop",
        "data": "spider",
        "reward_spec": {"method": "rule", "ground_truth": gold},
    }
    replies = [
        "<think>look at the prices</think><sql>SELECT name, price FROM items</sql>",
        "<think>names only</think><sql>SELECT nme FROM items</sql>",
        f"<think>book and lamp</think><solution>{gold}</solution>",
    ]
    first, turns = _through_ppoflow(f"{factory_file}:text2sql", row, replies)
    assert first is None and turns == _directly("text2sql", {"db_path": str(tmp_path)}, row, replies)
    assert "lamp" in turns[0][1] and "30.0" in turns[0][1]  # the real query's rows came back
    assert "no such column: nme" in turns[1][1]
    assert turns[-1][2:] == (1.0, True)
    # By SkyRL's rules (each turn opens with <think>, the solution's rows are compared): other rows score 0, a
    # solution without <think> breaks the format and scores -1.
    wrong = ["<think>all but the pen</think><solution>SELECT name FROM items WHERE price > 1</solution>"]
    assert _through_ppoflow(f"{factory_file}:text2sql", row, wrong)[1] == [("user", "", 0.0, True)]
    unformatted = [f"<solution>{gold}</solution>"]
    assert _through_ppoflow(f"{factory_file}:text2sql", row, unformatted)[1] == [("user", "", -1.0, True)]


def test_a_row_without_env_class_is_one_clear_error():
    with pytest.raises(
        EnvironmentFailed, match=r"\(row 3, sample 0\) reset: raised ValueError: the row has no 'env_cl"
    ):
        _through_ppoflow(ADAPTER, {"prompt": "2 + 2?", "label": "4"}, ["4"])


def test_the_library_version_is_in_the_identity(monkeypatch):
    import engines.environments.loader as loader

    before = load_environment_factory(ADAPTER).identity
    monkeypatch.setattr(loader, "_version", lambda name: "9.9.9" if name == "skyrl-gym" else "")
    assert load_environment_factory(ADAPTER).identity != before


OFFLINE_EPISODE = """
from engines.environments.checked import CheckedEnvironment
from engines.environments.loader import load_environment_factory
env = CheckedEnvironment.start(load_environment_factory("engines.environments.skyrl:SkyRLGymEnvironment"), 0)
env.reset({"prompt": "6 * 7?", "label": "42", "env_class": "gsm8k"})
obs = env.step([{"role": "assistant", "content": "#### 42"}])
env.close()
print(open("/proc/self/net/dev").read().count(":"), obs.reward, obs.done)
"""


def test_the_library_runs_with_no_network():
    """Import and an episode inside a network namespace of their own: one interface (loopback, down)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    command = ["unshare", "--net", "--map-root-user", sys.executable, "-c", OFFLINE_EPISODE]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"this kernel refuses network namespaces: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1.0", "True"]
