#!/usr/bin/env bash
# Write requirements-cpu.txt again: resolve pyproject.toml's ranges (torch, then .[cpu,dev]) into a new virtual
# environment as scripts/setup.sh does on a GPU-less machine with PPOFLOW_SETUP_RESOLVE=1, and list every release that
# environment holds. Run it after changing a dependency in pyproject.toml (tests/unit/test_requirements_lock.py fails
# until then); `make setup` then installs the new list.
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PPOFLOW_VENV="$work/venv" PPOFLOW_SETUP_RESOLVE=1 bash scripts/setup.sh
{
  echo "# The releases scripts/setup.sh installs on a CPU machine, every one pinned, installed with --no-deps after torch."
  echo "# Written by scripts/lock.sh from pyproject.toml; do not edit by hand. torch is pinned in pyproject.toml and installed"
  echo "# first by scripts/setup.sh; triton, torchvision, torchaudio and torchcodec are left out on purpose (scripts/setup.sh)."
  "$work/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(pip|wheel|torch)=='
} > requirements-cpu.txt.new
mv requirements-cpu.txt.new requirements-cpu.txt
echo "lock: requirements-cpu.txt lists $(grep -c '==' requirements-cpu.txt) releases"
