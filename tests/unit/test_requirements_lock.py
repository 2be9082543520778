"""requirements-cpu.txt (what scripts/setup.sh installs with --no-deps on a CPU machine) against pyproject.toml and
against the metadata of the releases it lists:

- every requirement pyproject.toml states (the dependencies, the cpu and dev extras) is met by the listed release;
- the list is closed: each listed release's own requirements (and those of the extras they ask for) are listed too,
  read from the installed releases' metadata, as `pip check` reads it; torch (installed first, pinned in
  pyproject.toml) and the GPU-only wheels setup.sh leaves out on purpose are the only names allowed to be missing.

A dependency changed in pyproject.toml without `bash scripts/lock.sh` fails the first test, naming the release.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-cpu.txt"
LEFT_OUT = {"triton", "torchvision", "torchaudio", "torchcodec"}  # scripts/setup.sh: GPU-only or CUDA-built


def _pins() -> dict[str, str]:
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line.strip())
        assert match, f"{LOCK.name}:{number}: {line!r} is not NAME==VERSION"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{LOCK.name}:{number}: {name} listed twice"
        pins[name] = match.group(2)
    return pins


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


_ENVIRONMENT = default_environment()  # this interpreter and platform, as markers see them


def _applies(requirement: Requirement, extra: str = "") -> bool:
    return requirement.marker is None or requirement.marker.evaluate({**_ENVIRONMENT, "extra": extra})


def _installed_torch() -> str:
    """The torch scripts/setup.sh installed first (a local build, e.g. 2.13.0+cpu), checked against pyproject's pin."""
    (torch,) = [r for r in map(Requirement, _project()["dependencies"]) if r.name == "torch"]
    version = importlib.metadata.version("torch")
    assert torch.specifier.contains(version, prereleases=True), f"torch {version} is installed, pyproject asks {torch}"
    return version


def test_the_list_meets_every_requirement_of_pyproject():
    project, pins = _project(), _pins()
    stated = [*project["dependencies"], *project["optional-dependencies"]["cpu"]]
    stated += project["optional-dependencies"]["dev"]
    assert "torch" not in pins, "torch is installed first by scripts/setup.sh, not from the list"
    for text in stated:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch" or not _applies(requirement):
            continue
        assert name in pins, f"pyproject.toml asks for {text!r}; {LOCK.name} has no {name}: run bash scripts/lock.sh"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"pyproject.toml asks for {text!r}; {LOCK.name} has {name}=={pins[name]}: run bash scripts/lock.sh"
        )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine resolves instead (scripts/setup.sh)")
def test_the_list_holds_what_its_releases_require():
    pins = _pins()
    available = {**pins, "torch": _installed_torch()}
    wanted = [(name, "") for name in pins]
    seen = set()
    missing = []
    while wanted:
        name, extra = wanted.pop()
        if (name, extra) in seen or name in LEFT_OUT:
            continue
        seen.add((name, extra))
        if name == "torch":
            continue  # torch's own requirements come with it from its index
        installed = importlib.metadata.distribution(name)
        assert installed.version == pins[name], f"{name} {installed.version} is installed, the list pins {pins[name]}"
        for text in installed.requires or []:
            requirement = Requirement(text)
            if not _applies(requirement, extra):
                continue
            dependency = canonicalize_name(requirement.name)
            if dependency in LEFT_OUT:
                continue
            if dependency not in available or not requirement.specifier.contains(
                available[dependency], prereleases=True
            ):
                missing.append(f"{name}{f'[{extra}]' if extra else ''} needs {text!r}")
                continue
            wanted += [(dependency, "")] + [(dependency, e) for e in requirement.extras]
    assert not missing, "\n".join(missing)
