"""Two nodes through the update stage (train.hostfile): rank 1 runs on "node 1", started by a real
`ppoflow rank-agent` that talks to rank 0 only through the rendezvous port, as it would on another machine.

Both nodes are this machine on loopback (CI has one), so what is shown is the protocol: the agent starts the
node's rank for each group, reports its death, rebuilds it after a failure, and its heartbeat tells a dead
node apart; what is not shown is a second machine's network and disk (the run folder is the same path).

The reference is the same 2-rank update on one node, already checked against 1 rank in test_update_ranks.py:
with the same 2 ranks doing the same arithmetic, the committed files must be the same bytes. The driver (a
subprocess: its process is rank 0) runs both, with scored shards sampled from the initial policy, so every
iteration trains on the same rows in both runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage.checkpoints import read_commit_marker
from storage.layout import layout_for
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 4
RANK1_RNG = ("trainer/rng.rank1.json", "trainer/rng.rank1.safetensors")
JOIN_S, LOST_S = 6.0, 3.0  # train.rank_agent_join_s, train.rank_heartbeat_lost_s (defaults 30, 10): shorter waits

DRIVER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from stages.policy import policy_ref
    from stages.rollout import run_rollout
    from stages.score import run_score
    from engines.trainer import rank_group
    from tests.integration.pipeline_helpers import small_config
    from tests.integration.test_update_ranks import step
    model, data, root, hostfile, port, agent_log = sys.argv[2:8]
    JOIN_S, LOST_S = float(sys.argv[8]), float(sys.argv[9])
    out = {}

    def config(run, train):
        return small_config(root, run, model, data, iterations=4, train={"num_ranks": 2, **train},
                            score={"cache": False}, run={"keep_checkpoints": 4})  # every iteration compared

    def prepare(cfg):
        first = policy_ref(cfg, 1)
        return {i: run_score(cfg, i, run_rollout(cfg, i, first)) for i in (1, 2, 3, 4)}

    def attempt(cfg, i, scored):
        try:
            step(cfg, i, scored)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def start_agent():
        argv = [sys.executable, "-m", "flows.cli", "rank-agent", "--master", f"127.0.0.1:{port}", "--node", "1"]
        return subprocess.Popen(argv, stdout=open(agent_log, "a"), stderr=subprocess.STDOUT)

    def ppid(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    one = config("one-node", {})
    scored = prepare(one)
    for i in (1, 2, 3, 4):
        step(one, i, scored)

    agent = start_agent()
    two = config(
        "two-nodes",
        {
            "hostfile": hostfile,
            "master_addr": "127.0.0.1",
            "master_port": int(port),
            "rank_agent_join_s": JOIN_S,
            "rank_heartbeat_lost_s": LOST_S,
        },
    )
    scored = prepare(two)
    out["starts"] = [step(two, i, scored).metrics["ranks/group_starts"] for i in (1, 2)]
    group = rank_group.current()
    out["agent_pid"], out["rank1_pid"] = agent.pid, group.pids[1]
    out["rank1_parent"] = ppid(group.pids[1])
    out["local_procs"] = sorted(group.procs)

    # rank 1 killed between iterations 2 and 3, on its node: the agent reports it, the update names it
    os.kill(group.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not group.store.check(["exit/1"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["killed_error"] = attempt(two, 3, scored)
    step(two, 3, scored)  # the retry: a new group, its rank 1 started by the same agent
    out["retry_pid"] = rank_group.current().pids[1]
    out["retry_parent"] = ppid(out["retry_pid"])

    # the agent killed (its rank ends with it): the next update names the node whose heartbeat stopped
    t0 = time.monotonic()  # the silence counts from the agent's last beat, at most 1 s (BEAT_S) before its kill
    agent.kill()
    agent.wait()
    out["agent_error"] = attempt(two, 4, scored)
    out["agent_error_s"] = time.monotonic() - t0
    # no agent at all: the group cannot start, and the error says what to run where
    t0 = time.monotonic()
    out["no_agent_error"] = attempt(two, 4, scored)
    out["no_agent_error_s"] = time.monotonic() - t0
    # an agent started again: the retry goes through
    agent = start_agent()
    step(two, 4, scored)
    rank_group.shutdown()
    agent.kill()
    print("RESULT " + json.dumps(out))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_node_through_its_rank_agent(tiny_model_dir, digits_dataset_dir, tmp_path):
    root = tmp_path / "runs"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# rank 0's node first\nlocalhost slots=1\n127.0.0.1 slots=1  # node 1: the agent's\n")
    port = _free_port()
    agent_log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, "-c", DRIVER, str(REPO), str(tiny_model_dir), str(digits_dataset_dir), str(root)]
    argv += [str(hostfile), str(port), str(agent_log), str(JOIN_S), str(LOST_S)]
    driver = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    agent_output = agent_log.read_text() if agent_log.is_file() else ""
    assert driver.returncode == 0, driver.stderr[-4000:] + "\nagent:\n" + agent_output[-2000:]
    out = json.loads(next(line for line in driver.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print("seconds to the error: agent killed (from its kill)", out["agent_error_s"], "none", out["no_agent_error_s"])

    # node 1's rank is the agent's child, not rank 0's: rank 0 started no process of its own
    assert out["rank1_parent"] == out["agent_pid"] and out["local_procs"] == []
    assert out["starts"][0] == out["starts"][1]  # one group kept over both iterations

    # a rank killed on node 1: named with its node, host, pid and signal, from the agent's report
    assert out["killed_error"] is not None
    assert out["killed_error"].startswith("RankDiedError: update rank 1 of 2 on node 1 ("), out["killed_error"]
    assert f"pid {out['rank1_pid']}) was killed by signal SIGKILL (9)" in out["killed_error"]
    assert out["retry_pid"] != out["rank1_pid"] and out["retry_parent"] == out["agent_pid"]

    # the agent killed: its heartbeat stops, the update names node 1 after train.rank_heartbeat_lost_s plus the
    # failed collective, not after the 1800 s collective timeout
    assert out["agent_error"] is not None
    assert out["agent_error"].startswith(
        "RankDiedError: update ranks 1..1 of 2 on node 1 (127.0.0.1): its rank agent sent no heartbeat"
    ), out["agent_error"]
    # 1.5: one beat period before the kill, and slack; +5 s: far below the 10 s default, so the setting is the one used
    assert LOST_S - 1.5 <= out["agent_error_s"] < LOST_S + 5
    # no agent: the group waits train.rank_agent_join_s, not 300 s, for a rank that nobody will start; it says
    # what to run
    assert out["no_agent_error"] is not None and JOIN_S <= out["no_agent_error_s"] < JOIN_S + 8  # default: 30 s
    assert f"run `ppoflow rank-agent --master 127.0.0.1:{port} --node 1` on 127.0.0.1" in out["no_agent_error"]
    assert "node 1" in agent_output and "connected" in agent_output  # the agent says what it does

    # After a kill of the rank, of the agent and a run without one, the two-node run staged at every iteration
    # the very bytes of the one-node run: weights, both ranks' optimizer partitions, trainer.json and both ranks'
    # RNG states (each rank's trainer seeds Python's, numpy's and torch's generators from run.seed when built
    # fresh; unseeded, rank 1's Python and numpy states differed between any two rank-1 processes).
    layouts = {
        run: layout_for(small_config(str(root), run, tiny_model_dir, digits_dataset_dir, ITERATIONS))
        for run in ("one-node", "two-nodes")
    }
    for iteration in range(1, ITERATIONS + 1):
        files = {run: read_commit_marker(layout, iteration)["files"] for run, layout in layouts.items()}
        assert set(files["one-node"]) == set(files["two-nodes"])
        assert {"trainer/actor_optimizer.rank1.safetensors", *RANK1_RNG} <= set(files["two-nodes"])
        for rel, info in files["one-node"].items():
            if rel not in ("config.yaml", "trainer/config.json"):
                assert files["two-nodes"][rel]["sha256"] == info["sha256"], (iteration, rel)
