#!/usr/bin/env bash
# Set up ppoflow on a fresh machine: a virtual environment in .venv with every dependency.
#   bash scripts/setup.sh
# torch goes in first and pinned, so nothing later pulls a CUDA build. On a CPU machine the rest is the releases listed in
# requirements-cpu.txt, installed as listed. Resolving pyproject.toml's ranges instead (a GPU machine, or
# PPOFLOW_SETUP_RESOLVE=1) drags in, through vLLM's CPU build, CUDA-built torchvision/torchaudio/torchcodec, which break
# transformers' imports: removed; and triton (1 GB, pulled in by xgrammar), which only serves GPU kernels: removed on
# machines without a GPU. requirements-cpu.txt is what that resolution leaves (scripts/lock.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PPOFLOW_VENV:-.venv}  # scripts/lock.sh builds one elsewhere
# A full disk fails pip half-way with a bare "[Errno 28]"; say up front what is needed and where.
NEED_GIB=${PPOFLOW_SETUP_NEED_GIB:-6}
if [ ! -f "$VENV/.ready" ]; then
  for dir in . "${TMPDIR:-/tmp}"; do
    free_gib=$(df -Pk "$dir" | awk 'NR==2 {printf "%d", $4 / 1048576}')
    if [ "$free_gib" -lt "$NEED_GIB" ]; then
      echo "setup: only ${free_gib} GiB free on the disk of $(cd "$dir" && pwd); installing into .venv needs" \
           "about ${NEED_GIB} GiB (PPOFLOW_SETUP_NEED_GIB overrides). Free some space and run it again." >&2
      exit 1
    fi
  done
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel
# --no-compile: pip would compile every module of every package (33k files, ~50 s of a 2-minute set-up on 2 cores);
# Python compiles the few thousand a process imports on first use instead, and caches them (__pycache__).
python -m pip install -q --no-compile "torch==2.13.0" ${PPOFLOW_TORCH_INDEX:+--index-url "$PPOFLOW_TORCH_INDEX"}
gpu=$(command -v nvidia-smi >/dev/null 2>&1 && echo yes || true)
if [ -z "${PPOFLOW_SETUP_RESOLVE:-}" ] && [ -z "$gpu" ]; then
  # A CPU machine gets the exact releases of requirements-cpu.txt (scripts/lock.sh writes it from pyproject.toml):
  # pip resolves nothing (~30 s on 2 cores) and never unpacks the GPU-only wheels the resolution pulls in.
  python -m pip install -q --no-compile --no-deps -r requirements-cpu.txt
  python -m pip install -q --no-compile --no-deps -e .
else
  python -m pip install -q --no-compile -e ".[cpu,dev]"
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  [ -n "$gpu" ] || python -m pip uninstall -y -q triton 2>/dev/null || true
fi
# prefect-kubernetes renders deploy/kubernetes/*.json for tests/unit/test_kubernetes_templates.py, in a folder of its
# own that only that test's subprocess puts on its path: installed in the environment, Prefect's server loads it as a
# collection at start-up and its import (kopf) turns uvicorn's start-up lines off. 0.7.11: the newest release that
# accepts prefect 3.7.7; --no-deps with the packages it adds to this environment, pinned.
python -m pip install -q --no-deps --upgrade --target "$VENV/k8s-site" prefect-kubernetes==0.7.11 \
  kubernetes-asyncio==36.1.0 kopf==1.45.2 iso8601==2.1.0 tenacity==9.2.1 pyOpenSSL==26.4.0
# The check imports what every ppoflow process imports, with bytecode caching on: those modules are compiled once,
# here, instead of by the first processes of a run or of the test suite (each its own compile when they start at once).
PYTHONDONTWRITEBYTECODE= python - <<'PY'
import torch, transformers, deepspeed, prefect, pyarrow, datasets, s3fs  # noqa: F401
from transformers import LlamaConfig  # fails if a CUDA torchvision is still installed
print(f"ppoflow environment ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"prefect {prefect.__version__}")
PY
