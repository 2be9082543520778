"""Two data-parallel ranks on CPU (gloo, real DeepSpeed), each handed only its own rows of the update batch
(PPOTrainer.update_rows, as the update stage's ranks are): each runs the old-log-prob forward on its 4 rows only,
and GRPO's group baseline over a group that straddles the two ranks is still taken over all 8 of its samples, so the
update equals the 1-rank update of the whole batch. The two ranks resume from a checkpoint ONE rank saved, and one
rank then resumes from theirs, so the optimizer state must carry across rank counts both ways (ZeRO 0: the whole
state on every rank; ZeRO 2: partitions cut again, engines/trainer/reshard.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.trainer.checkpoint import gathered_state_dict
from engines.trainer.ppo_trainer import PPOTrainer
from tests.integration.test_trainer import _batch, _cfg

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LR = 1e-3  # test_trainer._cfg's actor_lr
# GRPO (no critic), the KL in the loss with k3 (so the advantages are the group-normalised scores alone); 8 rows in
# ONE group; a step of 8 rows, 2 epochs; micro-batches of 2 rows (train.zero_stage is the test's parameter)
SETTINGS = {
    "algo.name": "grpo",
    "algo.kl_in_reward": "false",
    "algo.kl_estimator": "k3",  # k1 in the loss is refused (zero expected gradient)
    "rollout.prompts_per_iteration": 1,
    "rollout.n_samples": 8,
    "train.micro_batch_size": 2,
    "train.warmup_steps": 0,
}

RANK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from safetensors.torch import save_file
    from engines.trainer.checkpoint import gathered_state_dict
    from engines.trainer.ppo_trainer import PPOTrainer
    from tests.integration.test_trainer import _batch, _cfg
    from tests.integration.test_trainer_rank_rows import SETTINGS, one_group
    model_dir, out, ckpt, stage, saved = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
    cfg = _cfg(model_dir, **SETTINGS, **{"train.zero_stage": stage})
    trainer = PPOTrainer(cfg, ckpt + "/policy", trainer_state_dir=ckpt + "/trainer")
    rank = trainer.actor.global_rank
    forward_rows = []
    separate_pass = trainer._old_logprobs_and_values
    trainer._old_logprobs_and_values = lambda rows: (forward_rows.append(len(rows)), separate_pass(rows))[1]
    whole = one_group(_batch(model_dir, 2))
    own = whole.select(torch.arange(4 * rank, 4 * rank + 4))  # what the stage's rank r reads: rows [4r, 4r + 4)
    result = trainer.update_rows(own)
    actor = gathered_state_dict(trainer.actor)
    print("RANK", json.dumps({"rank": rank, "forward_rows": forward_rows, "advantages": result.advantages}))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in actor.items()}, out)
    trainer.save(saved)
""")


def one_group(batch):
    """The batch with all its rows samples of one prompt (group id 0)."""
    return dataclasses.replace(batch, group_ids=torch.zeros(len(batch), dtype=torch.long))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bounded_by_adam_steps(one: dict, two: dict, steps: int) -> None:
    """Weights of two runs whose gradients differed by fp32 rounding only, after `steps` Adam steps: each step
    moves a weight by at most ~lr, and a rounding-level gradient difference flips its direction only where the
    gradient is ~0, so every weight is within steps x 2 lr and all but a sliver (< 1%) within lr / 100.
    Had a resume dropped the saved Adam moments, its first step would move every weight with a gradient by ~lr
    (Adam's first step is lr * sign(gradient)) instead of the step the moments give: far beyond lr / 100."""
    assert set(one) == set(two)
    for k, v in one.items():
        delta = (two[k] - v).abs()
        assert float(delta.max()) <= steps * 2 * LR, k
        assert float((delta > LR / 100).float().mean()) < 1e-2, k


@pytest.mark.parametrize("stage", [0, 2])
def test_two_ranks_each_with_its_rows_take_the_one_rank_update(tiny_model_dir, tmp_path, stage):
    out, port, ckpt, saved = tmp_path / "actor.safetensors", str(_free_port()), tmp_path / "ckpt", tmp_path / "saved"
    cfg = _cfg(tiny_model_dir, **SETTINGS, **{"train.zero_stage": stage})
    # One rank: an update, saved; then the next update (the uninterrupted reference).
    one_rank = PPOTrainer(cfg, str(tiny_model_dir))
    one_rank.update(one_group(_batch(tiny_model_dir, 1)))
    one_rank.save(str(ckpt))
    batch = one_group(_batch(tiny_model_dir, 2))
    one_rank.update(batch)
    # Two ranks: resume from that checkpoint, the same next update, each rank handed its own 4 rows.
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            **dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-c", RANK, str(REPO), str(tiny_model_dir), str(out), str(ckpt), str(stage), str(saved)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    ranks = []
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        ranks.append(json.loads(next(x for x in stdout.splitlines() if x.startswith("RANK "))[len("RANK ") :]))

    # Each rank's old-log-prob forward pass ran once, on its own 4 rows (not on the batch of 8).
    assert [r["forward_rows"] for r in ranks] == [[4], [4]]

    # The one group's baseline over all 8 samples, by hand: advantage of row i = (s_i - mean s) / (std s + 1e-6)
    # (Bessel's std) on each of its tokens; a baseline per rank (4 samples each) would give other numbers.
    s = batch.scores.double()
    want = ((s - s.mean()) / (s.std() + 1e-6)).tolist()
    lengths = batch.response_mask.sum(dim=1).long().tolist()
    per_rank = (s[:4] - s[:4].mean()) / (s[:4].std() + 1e-6)
    assert float((per_rank - torch.tensor(want[:4], dtype=torch.float64)).abs().max()) > 0.05  # the test can fail
    for r in ranks:  # every rank holds the whole batch's advantages
        assert [len(a) for a in r["advantages"]] == lengths
        for row, adv in enumerate(r["advantages"]):
            assert adv == pytest.approx([want[row]] * lengths[row], abs=1e-5), row

    # The update: 2 ranks (resumed from 1) == 1 rank with the whole batch, up to fp32 summation order: 2 Adam steps
    # (2 epochs of one step) apart.
    _bounded_by_adam_steps(gathered_state_dict(one_rank.actor), load_file(str(out)), steps=2)
    # Back to one rank: resumed from the 2 ranks' checkpoint, the next update equals the uninterrupted one's, 4 steps
    # of rounding apart.
    resumed = PPOTrainer(cfg, str(saved / "policy"), trainer_state_dir=str(saved / "trainer"))
    assert resumed.update_count == 2
    third = one_group(_batch(tiny_model_dir, 3))
    resumed.update(third)
    one_rank.update(third)
    _bounded_by_adam_steps(gathered_state_dict(one_rank.actor), gathered_state_dict(resumed.actor), steps=4)
