"""RMTrainer on DeepSpeed (CPU): the reported loss is the Bradley-Terry loss of the model's own forward, and a
step split into micro-batches (ZeRO 2) has the whole step's gradient and moves the weights as the same step
taken whole (ZeRO 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    from engines.toy.preferences import build_preferences

    return build_preferences(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", num_pairs=40, seed=4)


def _trainer(model_dir, pairs_file, zero_stage: int, micro: int):
    from engines.models import load_tokenizer
    from engines.rm.data import load_preferences
    from engines.rm.trainer import RMTrainer
    from ppoflow.config import build_config

    cfg = build_config(
        {
            "run": {"seed": 1},
            "model": {"policy_path": str(model_dir)},
            "train": {"zero_stage": zero_stage},
            "rm_train": {
                "data_path": str(pairs_file),
                "eval_fraction": 0.0,
                "batch_size": 8,
                "micro_batch_size": micro,
                "lr": 1e-2,
            },
        },
        "test",
    )
    data = load_preferences(cfg.rm_train, load_tokenizer(model_dir), cfg.run.seed)
    return RMTrainer(cfg, data, str(model_dir))


def test_loss_is_the_models_bradley_terry_loss_and_micro_batches_change_nothing(tiny_model_dir, pairs_file):
    from engines.rm.batching import batch_for_step

    whole = _trainer(tiny_model_dir, pairs_file, zero_stage=0, micro=8)
    # The first step's batch scored by the HF model's own forward (its own pooling), one pair at a time.
    model, pairs = whole.engine.module, whole.data.train
    indices = batch_for_step(pairs.lengths(), 8, seed=1, step=0)
    with torch.no_grad():
        score = lambda ids: float(model(input_ids=torch.tensor([ids])).logits[0, 0])  # noqa: E731
        want = sum(
            float(F.softplus(torch.tensor(score(pairs.rejected_ids[i]) - score(pairs.chosen_ids[i])))) for i in indices
        ) / len(indices)
    assert whole.train_steps(1)["rm/loss"] == pytest.approx(want, abs=1e-5)
    whole.train_steps(3)

    split = _trainer(tiny_model_dir, pairs_file, zero_stage=2, micro=2)  # 4 micro-batches per step, ZeRO 2
    initial = [p.detach().clone() for p in split.engine.module.parameters()]
    whole_zero2 = _trainer(tiny_model_dir, pairs_file, zero_stage=2, micro=8)
    # Each micro-batch's loss is its share of the step's mean: the accumulated gradient (its norm, before
    # clipping) is the whole step's. AdamW alone would hide a wrong share (it is scale-invariant).
    norm_split, norm_whole = split.train_steps(1)["optim/grad_norm"], whole_zero2.train_steps(1)["optim/grad_norm"]
    assert norm_split == pytest.approx(norm_whole, rel=1e-4)
    split.train_steps(3)
    params = [
        (a.detach(), b.detach(), s)
        for a, b, s in zip(whole.engine.module.parameters(), split.engine.module.parameters(), initial)
    ]
    moved = max(float((a - s).abs().max()) for a, _, s in params)
    apart = max(float((a - b).abs().max()) for a, b, _ in params)
    # The same steps, gradients summed in another order: float32 rounding, which AdamW's division by sqrt(v)
    # enlarges for weights whose gradients are ~0 (4e-5 seen), against ~3e-2 moved by 3 steps at lr 1e-2.
    assert moved > 1e-2 and apart < 1e-3, (moved, apart)
