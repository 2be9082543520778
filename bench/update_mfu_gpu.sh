#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md's update_mfu rows, as one command on a GPU machine with torch + CUDA.
#   bash bench/update_mfu_gpu.sh            # writes the JSON lines to bench/results/update_mfu.jsonl and $OUT
# A machine without the project's packages gets them from wheels in .whl/ (deepspeed, pydantic, hjson,
# transformers; `pip wheel --no-deps deepspeed==0.19.8` and `pip download` them on a machine with the registry).
# Order: what BENCHMARKS.md needs first (bf16 PPO and GRPO with their profiles, the autocast recipe before it),
# then the experiments; each run is bounded, so one slow variant cannot eat the others' time.
set -uo pipefail
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
WORK=${WORK:-/tmp/ppoflow-mfu}
EXTRA=${EXTRA:-}
run() {
  echo "== $*" | tee -a "$OUT/log.txt"
  timeout "${PER_RUN_S:-200}" python3 -m bench.update_mfu --work-dir "$WORK" "$@" >>"$OUT/log.txt" 2>&1
  echo "== exit $?" | tee -a "$OUT/log.txt"
  tail -n 1 bench/results/update_mfu.jsonl | cut -c1-400
}
variants=(
  "--algo ppo --precision bf16 --profile"
  "--algo grpo --precision bf16 --profile"
  "--algo ppo --precision autocast --profile"
  "--algo grpo --precision bf16 --compile-layers"
  "--algo ppo --precision bf16 --compile-layers"
)
for variant in "${variants[@]}"; do
  # shellcheck disable=SC2086
  run $variant $EXTRA
done
cp bench/results/update_mfu.jsonl "$OUT/"
