"""train.num_ranks=2 through the update stage (CPU, gloo, real DeepSpeed): the rank group is started once and
kept over three iterations, takes the 1-rank updates (weights within float tolerance), and a rank killed in the
middle of an update or between iterations fails that update naming it; re-running the stage starts a new group
from the committed checkpoint, and after both failures the run stages the very files the never-killed run did.

The two-rank runs happen in a driver subprocess (its process is rank 0; the rank group's world must not be
this pytest process's), the 1-rank reference in this process, both at once. All three runs train on the same
scored shards: every iteration's rollout is sampled from the initial policy, so the shards do not depend on
the weights and any difference comes from the update alone (compared row by row).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from engines.trainer import rank_group
from stages.checkpoint import run_checkpoint
from stages.policy import policy_ref
from stages.rollout import run_rollout
from stages.score import run_score
from stages.update import run_update
from storage.checkpoints import read_commit_marker
from storage.layout import layout_for
from storage.shards import read_shards
from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = (1, 2, 3)
LR = 1e-3  # pipeline_helpers.SMALL's actor_lr and critic_lr
# ZeRO-3, the stage whose save is itself a collective (the weights are gathered from both ranks' partitions);
# the default stage 2 runs on ranks in test_update_ranks_worker.py.
ZERO = {"zero_stage": 3}

DRIVER = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from tests.integration.test_update_ranks import prepare, step
    from tests.integration.pipeline_helpers import small_config
    from engines.trainer import rank_group
    model, data, root = sys.argv[2:5]
    out = {}

    def config(run):
        train = {"num_ranks": 2, "zero_stage": 3}  # as ZERO below
        return small_config(root, run, model, data, iterations=3, train=train, score={"cache": False})

    live = config("live")
    scored = prepare(live)
    out["live"] = []
    for i in (1, 2, 3):
        metrics = step(live, i, scored).metrics
        out["live"].append({"starts": metrics["ranks/group_starts"], "world": metrics["ranks/world_size"],
                            "pids": rank_group.current().pids, "metrics": metrics})
    killed = config("killed")
    scored = prepare(killed)
    step(killed, 1, scored)
    # rank 1 killed in the middle of iteration 2's update (right after rank 0 told it to train): rank 0's next
    # collective fails, and the error names rank 1; the re-run stage starts a second group
    group = rank_group.current()
    send = group.send

    def send_then_kill(command):
        send(command)
        if command["op"] == "update":
            os.kill(group.pids[1], signal.SIGKILL)

    group.send = send_then_kill
    try:
        step(killed, 2, scored)
        out["mid_error"] = None
    except Exception as exc:
        out["mid_error"] = f"{type(exc).__name__}: {exc}"
    step(killed, 2, scored)
    # rank 1 killed between iterations 2 and 3
    group = rank_group.current()
    out["killed_pid"] = group.pids[1]
    os.kill(group.pids[1], signal.SIGKILL)
    group.procs[1].wait(timeout=30)  # gone before the next stage starts: "between iterations"
    try:
        step(killed, 3, scored)
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["retry_starts"] = step(killed, 3, scored).metrics["ranks/group_starts"]
    out["retry_pids"] = rank_group.current().pids
    print("RESULT " + json.dumps(out))
""")


def prepare(cfg) -> dict:
    """Scored shards of iterations 1-3, each sampled with the initial policy (so the same in every run)."""
    first = policy_ref(cfg, 1)
    return {i: run_score(cfg, i, run_rollout(cfg, i, first)) for i in ITERATIONS}


def step(cfg, iteration: int, scored: dict):
    """The update and checkpoint stages of one iteration, as the pipeline runs them; returns the update manifest."""
    update = run_update(cfg, iteration, policy_ref(cfg, iteration), scored[iteration])
    run_checkpoint(cfg, iteration, update)
    return update


def _scored_rows(run_dir: Path, iteration: int) -> dict:
    return read_shards(fsspec.filesystem("file"), str(run_dir / f"iter-{iteration:06d}" / "scored")).to_pydict()


def _weights(root: Path, run: str) -> dict:
    """The committed iteration-3 policy and critic weights of `run` under `root`."""
    ckpt = root / run / "checkpoints" / "iter-000003"
    return {
        **{"policy." + k: v for k, v in load_file(str(ckpt / "policy" / "model.safetensors")).items()},
        **{"critic." + k: v for k, v in load_file(str(ckpt / "critic" / "model.safetensors")).items()},
        **{"head." + k: v for k, v in load_file(str(ckpt / "critic" / "value_head.safetensors")).items()},
    }


def test_two_ranks_through_the_update_stage(tiny_model_dir, digits_dataset_dir, tmp_path):
    root = tmp_path / "ranks"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", DRIVER, str(REPO), str(tiny_model_dir), str(digits_dataset_dir), str(root)]
    driver = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the driver's OMP_NUM_THREADS=1: the same kernels give the same scored floats
    try:
        # The 1-rank reference, meanwhile: the same stages with num_ranks=1 (no process started).
        one = small_config(
            str(tmp_path / "one"), "one", tiny_model_dir, digits_dataset_dir, 3, train=ZERO, score={"cache": False}
        )
        starts_before = rank_group.group_starts()  # earlier tests in this process may have started groups
        scored = prepare(one)
        one_metrics = [step(one, i, scored).metrics for i in ITERATIONS]
        assert all("ranks/group_starts" not in m for m in one_metrics)
        assert rank_group.group_starts() == starts_before  # 1 rank: no group started
        stdout, stderr = driver.communicate(timeout=400)
    finally:
        driver.kill()
        torch.set_num_threads(threads)
    assert driver.returncode == 0, stderr[-4000:]
    out = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    for i in ITERATIONS:  # the same rows in every run (sampled from the initial policy, scored alike)
        assert _scored_rows(root / "live", i) == _scored_rows(tmp_path / "one" / "one", i)

    # One group for the whole live run: started at the first update, the same rank-1 process after the third.
    assert [it["starts"] for it in out["live"]] == [1.0, 1.0, 1.0]
    assert [it["world"] for it in out["live"]] == [2.0, 2.0, 2.0]
    assert out["live"][0]["pids"] == out["live"][2]["pids"]

    # Iteration 1 starts from the initial weights in both runs. Each rank read and ran the old-log-prob and value
    # forward on its own 8 rows, padded to the whole batch's widths, as the micro-batches one rank cuts (rows 0-7,
    # 8-15): the same numbers up to kernel rounding (log-probs ~4 nats, fp32: a few 1e-7). The advantages are
    # whitened over all 16 rows on every rank, so they agree as tightly. Whitening each rank's 8 rows apart would
    # give each half a token mean of 0: off by that half's token mean in the 1-rank advantages (some token of the
    # half then differs by at least as much), which is far above the 1e-5 allowed here.
    experience = {
        run: read_shards(fsspec.filesystem("file"), str(path / "iter-000001" / "experience")).to_pydict()
        for run, path in (("two", root / "live"), ("one", tmp_path / "one" / "one"))
    }
    for column in ("old_logprobs", "values", "advantages", "returns"):
        for row, (two_row, one_row) in enumerate(zip(experience["two"][column], experience["one"][column])):
            assert two_row == pytest.approx(one_row, abs=1e-5), (column, row)
    halves = [[a for row in experience["one"]["advantages"][h : h + 8] for a in row] for h in (0, 8)]
    assert max(abs(sum(half) / len(half)) for half in halves) > 1e-3  # the check above can tell the two apart

    # 2 ranks == 1 rank: the same token-mean loss over the step's tokens, so the same gradient up to fp32
    # summation order (a mean of per-rank means would differ by far more: the ranks' token counts differ).
    # Adam turns an fp32-rounding difference in a near-zero gradient into at most 2 lr per step where the sign
    # flips, so three steps bound every weight by 3 x 2 lr; all but a sliver (< 1%) agree within lr / 100.
    # The gradient's scale too (Adam alone hardly sees it): the loss and the pre-clip norm of the step's gradient
    # of every iteration are the 1-rank ones (a mean of per-rank means would halve the norm).
    for two, one_m in zip((it["metrics"] for it in out["live"]), one_metrics):
        for key in ("loss/policy", "loss/value"):
            assert two[key] == pytest.approx(one_m[key], abs=1e-5), key
        for key in ("optim/actor_grad_norm", "optim/critic_grad_norm"):
            assert two[key] == pytest.approx(one_m[key], rel=1e-4), key
    one_rank, two_ranks = _weights(tmp_path / "one", "one"), _weights(root, "live")
    assert set(one_rank) == set(two_ranks)
    for k, v in one_rank.items():
        delta = (two_ranks[k] - v).abs()
        assert float(delta.max()) <= 3 * 2 * LR, k
        assert float((delta > LR / 100).float().mean()) < 1e-2, k

    # Rank 1 killed between iterations 2 and 3: the next update fails naming it ...
    assert out["error"] is not None and out["error"].startswith("RankDiedError: update rank 1 of 2"), out["error"]
    assert f"(pid {out['killed_pid']}) was killed by signal SIGKILL (9)" in out["error"]
    # ... as does one killed in the middle of an update (gloo's error on rank 0 names no rank; the stage's does)
    assert out["mid_error"] is not None and out["mid_error"].startswith("RankDiedError: update rank 1 of 2")
    assert "was killed by signal SIGKILL (9)" in out["mid_error"]
    # re-running the stage starts a new group (a new rank-1 process) from the committed checkpoint: a second
    # one after the kill in the middle of iteration 2, a third after the one between iterations 2 and 3
    assert out["retry_starts"] == 3.0 and out["retry_pids"]["1"] != out["killed_pid"]
    # that stages byte for byte the files of the never-killed run: weights, every rank's optimizer partition,
    # RNG states, trainer.json (only the two copies of the config differ: they name the run).
    layout_of = {
        run: layout_for(small_config(str(root), run, tiny_model_dir, digits_dataset_dir, 3))
        for run in ("live", "killed")
    }
    files = {run: read_commit_marker(layout, 3)["files"] for run, layout in layout_of.items()}
    assert {"trainer/actor_optimizer.rank1.safetensors", "trainer/rng.rank1.json"} <= set(files["live"])
    for rel, info in files["live"].items():
        if rel not in ("config.yaml", "trainer/config.json"):
            assert files["killed"][rel]["sha256"] == info["sha256"], rel
