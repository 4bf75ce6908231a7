#!/usr/bin/env bash
# Where a decode step's time goes, kernel by kernel, on a machine with an NVIDIA GPU and Nsight
# Compute (`ncu`). Builds nothing: takes the binaries of scripts/gpu-build.sh.
#
#   scripts/gpu-profile.sh [BIN_DIR]      (default .device-carry)
#
# 1. Kernel times of single-request decode (llama-3.2-1b and llama-3.1-8b shapes, random bf16
#    weights, 128-token prompt, 32 output tokens) without CUDA graphs, so that each kernel is
#    timed on its own; the totals are divided by the 31 decode steps (the one prefill step is
#    counted in them too).
# 2. The decode attention kernel at batch 256, context 640 (attention_bench's second case) with
#    ncu's throughput, memory, occupancy and warp-stall sections.
# MODELS (default: both) picks the models of part 1; ATTENTION=0 skips part 2. Logs go to $OUT
# (default: a new temporary directory).
set -u
BIN=${1:-.device-carry}
OUT=${OUT:-$(mktemp -d)}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -z "$NCU" ]; then
    echo "no ncu on this machine" >&2
    exit 1
fi
# Leave the clocks as they are (the machine's own setting), as in every other measurement.
# CACHE=none keeps the L2 between kernels (as in a graph replay, where a small kernel's inputs
# are still in the L2) instead of flushing it before each one.
ncu_run() { timeout "${PROFILE_TIMEOUT:-200}" "$NCU" --clock-control none --cache-control "${CACHE:-all}" "$@"; }

for model in ${MODELS:-llama-3.2-1b llama-3.1-8b}; do
    FERROLM_CUDA_GRAPHS=0 ncu_run --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/$model.csv" \
        "$BIN/ferrolm" bench latency --model-config "bench-configs/$model.json" --dummy-weights --device cuda \
        --input-len 128 --output-len 32 --num-iters 1 --num-iters-warmup 0 --bandwidth-repetitions 1 \
        >"$OUT/$model.log" 2>&1 || tail -n 5 "$OUT/$model.log"
    echo "== $model, single-request decode, per step of 31 =="
    python3 tools/ncu_summary.py "$OUT/$model.csv" --steps 31 --top 25 | tee "$OUT/$model.txt"
done

if [ "${ATTENTION:-1}" = 1 ] && [ -x "$BIN/attention_bench" ]; then
    # The first case (batch 1) makes 148 decode launches (32 warm-up, 20 timed, 3 x 32); the next
    # one is the batch-256 case's first.
    echo "== decode attention, batch 256, context 640 =="
    ncu_run -k regex:paged_attention_decode --launch-skip 148 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        "$BIN/attention_bench" 2>&1 | tee "$OUT/decode-attention.txt" | grep -v "^==PROF==" | head -150
fi
