#!/usr/bin/env bash
# Set up ppoflow on a fresh machine: a virtual environment in .venv with every dependency.
#   bash scripts/setup.sh
# torch goes in first and pinned, so nothing later pulls a CUDA build; vLLM's CPU build comes next and
# drags in CUDA-built torchvision/torchaudio/torchcodec, which break transformers' imports: removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q "torch==2.13.0" ${PPOFLOW_TORCH_INDEX:+--index-url "$PPOFLOW_TORCH_INDEX"}
python -m pip install -q -e ".[cpu,dev]"
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import torch, transformers, deepspeed, prefect, pyarrow, datasets, s3fs  # noqa: F401
from transformers import LlamaConfig  # fails if a CUDA torchvision is still installed
print(f"ppoflow environment ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"prefect {prefect.__version__}")
PY
