"""Forking a run (flows/fork.py) with the in-process training flow, tiny model, CPU.

The parent `base` (run.keep_checkpoints=1) trains iterations 1..2 and is forked at 2 twice: `same` with nothing
changed, `kl` with algo.kl_coef=0.5. Then the parent trains on to 4: its retention removes checkpoints 1 and 3
but keeps 2, which the forks pin. Then:
- `same` trains 3..4: its checkpoint 4 is byte-equal to the parent's (policy, critic, optimizer state), its
  metrics rows 3 and 4 hold the parent's values (timings and score-cache counters aside);
- `kl` trains 3 under its own setting (other losses than the parent's iteration 3), and its folder holds no copy
  of iterations 1..2: a reference file and its config, < 1% of the parent's bytes for them;
- after both forks moved past 2 (their own retention dropped their references), the parent's retention removes
  checkpoint 2, and `kl` still resumes (to 4) from its own checkpoint 3.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

# Metrics that differ between two runs computing the same thing: wall times, and the shared score cache's counters.
_NOT_COMPARED = ("timing/", "time/", "score/cache_")


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of a checkpoint's policy/, critic/, trainer/ files, but the trainer's copy of the config (it names
    the run) and its record of the process's RNG state (other stages of the process draw from it too)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for part in ("policy", "critic", "trainer")
        for p in sorted((folder / part).rglob("*"))
        if p.is_file() and not (part == "trainer" and (p.name == "config.json" or p.name.startswith("rng.")))
    }


def _bytes(*folders: Path) -> int:
    return sum(p.stat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())


def _train(cfg) -> dict:
    from flows.training import ppo_training

    state = ppo_training(config=cfg.model_dump(mode="json"), return_state=True)
    assert state.is_completed(), state
    return state.result()


def test_fork_shares_the_parents_iterations_and_continues_from_its_checkpoint(
    prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir
):
    from engines import warm
    from flows.fork import fork_run
    from flows.records import read_metrics
    from storage import lineage
    from storage.checkpoints import apply_retention, checkpoint_iterations
    from storage.layout import layout_for

    root = tmp_path / "root"
    base = small_config(
        str(root), "base", tiny_model_dir, digits_dataset_dir, iterations=2, run={"keep_checkpoints": 1}
    )
    _train(base)
    same = fork_run(str(root), "base", 2, "same", ["run.iterations=4"])
    kl = fork_run(str(root), "base", 2, "kl", ["run.iterations=3", "algo.kl_coef=0.5"])
    parent = layout_for(base)
    base_dir, kl_dir = Path(parent.run_dir), Path(layout_for(kl).run_dir)
    shared_in_parent = [base_dir / "iter-000001", base_dir / "iter-000002", base_dir / "checkpoints/iter-000002"]
    fork_bytes, parent_bytes = _bytes(kl_dir), _bytes(*shared_in_parent)
    print(
        f"fork's bytes for iterations 1..2: {fork_bytes} (config, run.json, LATEST, reference), parent's {parent_bytes}"
    )
    assert fork_bytes < 0.01 * parent_bytes

    _train(base.model_copy(update={"run": base.run.model_copy(update={"iterations": 4})}))
    assert checkpoint_iterations(parent) == {2: True, 4: True}  # 1 and 3 removed by retention; 2 pinned

    warm.invalidate()  # as a new process would: no trainer or engines left from the parent
    result = _train(same)
    assert (result["first_iteration"], result["last_iteration"]) == (3, 4)
    same_dir = Path(layout_for(same).run_dir)
    assert _digests(same_dir / "checkpoints/iter-000004") == _digests(base_dir / "checkpoints/iter-000004")
    parent_rows = {row["iteration"]: row for row in read_metrics(parent)}
    fork_rows = read_metrics(layout_for(same))
    assert [row["iteration"] for row in fork_rows] == [3, 4]
    for row in fork_rows:
        compared = {k: v for k, v in row.items() if not k.startswith(_NOT_COMPARED)}
        assert compared == {k: v for k, v in parent_rows[row["iteration"]].items() if not k.startswith(_NOT_COMPARED)}

    warm.invalidate()
    _train(kl)
    (kl_row,) = read_metrics(layout_for(kl))
    assert (kl_row["iteration"], kl_row["kl/coef"], parent_rows[3]["kl/coef"]) == (3, 0.5, 0.01)
    assert kl_row["returns/mean"] != parent_rows[3]["returns/mean"]  # the KL penalty in the reward: 50x
    assert kl_row["reward/mean"] == parent_rows[3]["reward/mean"]  # same samples (policy 2), another update
    assert sorted(p.name for p in kl_dir.glob("iter-*")) == ["iter-000003"]  # no copy of 1..2, trained or not

    # Both forks trained past 2 with keep_checkpoints=1: their references and pins are gone, the parent may delete 2.
    assert lineage.pinned_iterations(parent) == set()
    assert apply_retention(parent, 1) == [2]
    warm.invalidate()
    result = _train(kl.model_copy(update={"run": kl.run.model_copy(update={"iterations": 4})}))
    assert (result["first_iteration"], result["last_iteration"]) == (4, 4)


def _policy_weights(checkpoint: Path):
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(checkpoint / "policy" / "model.safetensors"))
    return torch.cat([tensors[name].flatten().double() for name in sorted(tensors)])


def test_a_fork_trains_with_its_own_learning_rate(prefect_api, tmp_path, tiny_model_dir, digits_dataset_dir):
    """The parent trains iteration 1 at actor_lr = critic_lr = 1e-3 (constant schedule); two forks at 1 train
    iteration 2 from its checkpoint: `same` (nothing changed) and `lr` (actor_lr 3e-3, critic_lr 2e-3, restored
    into the optimizer and scheduler that checkpoint 1 saved at 1e-3). `lr`'s row reports its rates, and its update
    moved the policy 3x as far as `same`'s, in the same direction: AdamW's step -lr * (m_hat / (sqrt(v_hat) + eps)
    + wd * p) is linear in lr for the same moments (checkpoint 1's) and gradients (the same rows: both sample with
    policy 1, as the parent would)."""
    import torch

    from engines import warm
    from flows.fork import fork_run
    from flows.records import read_metrics
    from storage.layout import layout_for

    root = tmp_path / "root"
    base = small_config(str(root), "base", tiny_model_dir, digits_dataset_dir, iterations=1)
    _train(base)
    same = fork_run(str(root), "base", 1, "same", ["run.iterations=2"])
    lr = fork_run(str(root), "base", 1, "lr", ["run.iterations=2", "train.actor_lr=3e-3", "train.critic_lr=2e-3"])
    for fork in (same, lr):
        warm.invalidate()
        _train(fork)
    (same_row,), (lr_row,) = read_metrics(layout_for(same)), read_metrics(layout_for(lr))
    assert (same_row["optim/actor_lr"], same_row["optim/critic_lr"]) == (1e-3, 1e-3)
    assert (lr_row["optim/actor_lr"], lr_row["optim/critic_lr"]) == (3e-3, 2e-3)

    start = _policy_weights(root / "base" / "checkpoints/iter-000001")
    moved_same = _policy_weights(root / "same" / "checkpoints/iter-000002") - start
    moved_lr = _policy_weights(root / "lr" / "checkpoints/iter-000002") - start
    ratio = (moved_lr.norm() / moved_same.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(moved_lr, moved_same, dim=0).item()
    print(f"policy moved {ratio:.5f}x as far at 3x the learning rate (cosine {cosine:.6f})")
    assert abs(ratio - 3.0) < 0.01 and cosine > 0.999
