"""engines/scoring/file_weights.py on the tiny Llama: the reference's weights become pages of the model's safetensors
file, checked against the kernel's account (/proc/self/maps and smaps), and its log-probs against a plain forward."""

import re
from pathlib import Path

import pytest
import torch

from engines.models import load_reference
from engines.scoring.file_weights import map_to_files
from engines.scoring.reference import ReferenceModel

PROMPTS = [[1, 14, 15], [1, 9], [1, 20, 21, 22]]
RESPONSES = [[17, 18, 2], [30], [5, 6]]


def _file_regions(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, Rss in KiB) of each mapping of `path` in this process, from /proc/self/smaps."""
    regions, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            current = (int(head[1], 16), int(head[2], 16)) if head[3] == str(path) else None
        elif current and line.startswith("Rss:"):
            regions.append((*current, int(line.split()[1])))
    return regions


def _by_hand(model, prompts, responses, temperature: float) -> list[list[float]]:
    """log softmax(logits / T) of each response token, one unpadded sequence at a time."""
    out = []
    for p, r in zip(prompts, responses):
        logits = model(torch.tensor([p + r])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out.append([logp[len(p) - 1 + k, tok].item() for k, tok in enumerate(r)])
    return out


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_the_reference_weights_are_file_pages_dropped_after_each_score(tiny_model_dir):
    weights = Path(tiny_model_dir) / "model.safetensors"
    reference = ReferenceModel(str(tiny_model_dir), temperature=0.7, micro_batch_size=2)
    pointers = [p.data_ptr() for p in reference.model.parameters()]

    def resident_kib() -> int:
        """Rss of the file's mappings that hold this reference's parameters (other tests may map the file too)."""
        regions = [r for r in _file_regions(weights) if any(r[0] <= ptr < r[1] for ptr in pointers)]
        return sum(rss for *_, rss in regions)

    regions = _file_regions(weights)
    inside = [any(a <= ptr < b for a, b, _ in regions) for ptr in pointers]
    assert inside and all(inside), "a parameter still lives outside the file's mappings"
    assert resident_kib() == 0  # released once mapped

    with reference.in_use():
        first = reference.logprobs(PROMPTS, RESPONSES)
        assert resident_kib() > 0  # read while scoring, kept for the next call
        assert reference.logprobs(PROMPTS, RESPONSES) == first
    assert resident_kib() == 0  # the outermost exit dropped them

    again = reference.logprobs(PROMPTS, RESPONSES)  # faulted in again from the page cache: the same bits
    assert again == first
    plain = load_reference(tiny_model_dir)
    for ours, theirs in zip(first, _by_hand(plain, PROMPTS, RESPONSES, 0.7)):
        assert ours == pytest.approx(theirs, abs=1e-5)


def test_a_parameter_that_differs_from_its_file_keeps_its_own_copy(tiny_model_dir):
    model = load_reference(tiny_model_dir)
    changed = model.model.norm.weight
    with torch.no_grad():
        changed.add_(1.0)
    kept = changed.detach().clone()
    mapped = map_to_files(model, tiny_model_dir)
    unique = len(list(model.parameters()))
    assert mapped is not None and mapped.parameters == unique - 1
    assert torch.equal(model.model.norm.weight, kept)  # not replaced by the file's value


def test_a_folder_without_mappable_weights_maps_nothing(tiny_model_dir, tmp_path):
    model = load_reference(tiny_model_dir).to(torch.bfloat16)  # the file holds float32: no dtype matches
    assert map_to_files(model, tiny_model_dir) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{]")
    with pytest.raises(ValueError, match=r"broken/model\.safetensors is not a safetensors file"):
        map_to_files(model, broken)
