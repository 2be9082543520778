"""RewardModelSource on a tiny random Llama reward model built locally and loaded with from_pretrained."""

import random
import shutil

import pytest
import torch

from engines.rewards.base import RewardBatch, RewardError
from engines.rewards.model import RewardModelSource, folder_fingerprint
from engines.toy.reward_model import build_tiny_reward_model
from engines.toy.task import make_rows


def make_batch(n: int, seed: int = 0) -> RewardBatch:
    """Digits prompts with responses of 1-12 words (so lengths differ and batches need padding)."""
    rows, rng = make_rows(n, seed), random.Random(seed)
    responses = [" " + " ".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))) for _ in range(n)]
    return RewardBatch(
        prompts=rows["prompt"],
        responses=responses,
        prompt_ids=[[]] * n,
        response_ids=[[]] * n,
        labels=rows["label"],
        sample_ids=[f"row {i}" for i in range(n)],
    )


def single(batch: RewardBatch, i: int) -> RewardBatch:
    return RewardBatch([batch.prompts[i]], [batch.responses[i]], [[]], [[]], [batch.labels[i]], sample_ids=[f"row {i}"])


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", seed=0)


@pytest.fixture(scope="module")
def rm_source(rm_dir):
    return RewardModelSource(rm_dir, name="rm", batch_size=8)


class TestScores:
    def test_batched_equals_one_by_one(self, rm_source):
        # 20 rows of different lengths: batched, they are sorted, right-padded and split into 3 forward
        # passes of at most 8. Causal attention means pad tokens after a row cannot change it, so the only
        # difference allowed is float32 rounding from other matmul shapes (~1e-7 seen); 1e-5 leaves
        # room for BLAS differences, while a padding or pooling bug moves scores by ~1e-2 (their spread
        # across these rows is ~0.15).
        batch = make_batch(20)
        calls = rm_source.model_calls
        batched = rm_source.score(batch)
        assert rm_source.model_calls - calls == 3  # ceil(20 / 8)
        alone = [rm_source.score(single(batch, i))[0] for i in range(20)]
        assert batched == pytest.approx(alone, abs=1e-5)
        assert len(set(round(s, 4) for s in batched)) > 10  # the rows really score differently

    def test_empty_batch_scores_nothing(self, rm_source):
        assert rm_source.score(RewardBatch([], [], [], [], [])) == []

    def test_int8_dynamic_close_to_float32(self, rm_dir, rm_source):
        # int8 per-tensor weights round each weight to max|w|/127 steps (about 1% of a weight's spread for
        # these Gaussian inits) and activations are quantized per batch, so scores move by a few percent of
        # their spread (mean error ~5% of the std seen) while keeping the ranking; a model with other weights
        # (seed 1) has correlation ~0 with these scores, so both bounds below separate "close" from "other".
        batch = make_batch(64, seed=1)
        int8 = RewardModelSource(rm_dir, name="rm8", batch_size=16, quantize="int8-dynamic")
        assert any(type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") for m in int8.model.modules())
        fp32 = torch.tensor(rm_source.score(batch))
        q8 = torch.tensor(int8.score(batch))
        assert not torch.equal(fp32, q8)
        corr = torch.corrcoef(torch.stack([fp32, q8]))[0, 1].item()
        assert corr > 0.98
        assert (fp32 - q8).abs().mean().item() < 0.15 * fp32.std().item()
        assert int8.identity != rm_source.identity


class TestIdentity:
    def test_same_weights_same_identity_anywhere(self, rm_dir, rm_source, tmp_path):
        copy = shutil.copytree(rm_dir, tmp_path / "copy")
        assert RewardModelSource(copy, name="rm", batch_size=8).identity == rm_source.identity

    def test_changed_weight_file_changes_identity(self, rm_dir, tmp_path):
        folder = shutil.copytree(rm_dir, tmp_path / "rm")
        before = RewardModelSource(folder, name="rm").identity
        # Same architecture, same file size, other weights: only the content differs.
        other = build_tiny_reward_model(tmp_path / "seed1", seed=1)
        assert (other / "model.safetensors").stat().st_size == (folder / "model.safetensors").stat().st_size
        shutil.copyfile(other / "model.safetensors", folder / "model.safetensors")
        assert RewardModelSource(folder, name="rm").identity != before

    def test_fingerprint_reads_content_not_names(self, rm_dir, tmp_path):
        folder = shutil.copytree(rm_dir, tmp_path / "rm")
        fp = folder_fingerprint(folder)
        weights = folder / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01  # flip one bit of the last weight
        weights.write_bytes(bytes(data))
        assert folder_fingerprint(folder) != fp


class TestErrors:
    def test_two_label_classifier_is_refused(self, tmp_path):
        folder = build_tiny_reward_model(tmp_path / "two", num_labels=2)
        with pytest.raises(RewardError, match=rf"{folder}.*num_labels=2"):
            RewardModelSource(folder, name="rm")

    def test_causal_lm_is_refused(self, tiny_model_dir):
        with pytest.raises(RewardError, match="not a \\*ForSequenceClassification"):
            RewardModelSource(tiny_model_dir, name="rm")

    def test_missing_folder(self, tmp_path):
        with pytest.raises(RewardError, match="does not exist"):
            RewardModelSource(tmp_path / "nope", name="rm")

    def test_too_long_input_names_the_sample(self, rm_dir):
        # "say 1 : 1" is <s> + 4 words = 5 tokens; row 2 adds 7 more words, 12 > 6.
        source = RewardModelSource(rm_dir, name="rm", max_length=6)
        batch = RewardBatch(
            ["say 1 :"] * 3,
            [" 1", " 1", " 1 2 3 4 5 6 7 8"],
            [[]] * 3,
            [[]] * 3,
            ["1"] * 3,
            sample_ids=["row 0", "row 1", "row 2"],
        )
        with pytest.raises(RewardError, match="row 2 has .* tokens, more than max_length=6"):
            source.score(batch)

    def test_bitsandbytes_needs_a_gpu(self, rm_dir):
        # The bitsandbytes path itself is not exercised: no GPU on the CPU machines.
        with pytest.raises(RewardError, match="needs a CUDA GPU"):
            RewardModelSource(rm_dir, name="rm", quantize="bnb-4bit", device="cpu")

    def test_unknown_quantize(self, rm_dir):
        with pytest.raises(RewardError, match="quantize='int4'"):
            RewardModelSource(rm_dir, name="rm", quantize="int4")
