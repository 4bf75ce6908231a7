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
# 2. The decode attention kernel at batch 384, context 1500 (attention_bench's case) with ncu's
#    throughput, memory, occupancy and warp-stall sections.
# 3. One decode step of 384 requests at context ~1500 in the llama-3.1-8b shape cut to 4 layers
#    (the per-layer kernels are the 8B's), kernel by kernel without graphs; then the same step's
#    graph replayed as one workload, against its kernels one by one: what the graph adds or hides.
# MODELS (default: both) picks the models of part 1 (any bench-configs/ name) and OUTPUT_LEN (default
# 32) their output tokens; ATTENTION=0 skips part 2, BATCH=0 part 3.
# Logs go to $OUT (default: a new temporary directory).
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
        --input-len 128 --output-len "${OUTPUT_LEN:-32}" --num-iters 1 --num-iters-warmup 0 --bandwidth-repetitions 1 \
        >"$OUT/$model.log" 2>&1 || tail -n 5 "$OUT/$model.log"
    steps=$((${OUTPUT_LEN:-32} - 1))
    echo "== $model, single-request decode, per step of $steps =="
    python3 tools/ncu_summary.py "$OUT/$model.csv" --steps "$steps" --top 25 | tee "$OUT/$model.txt"
done

if [ "${ATTENTION:-1}" = 1 ] && [ -x "$BIN/attention_bench" ]; then
    # The case makes 52 launches (32 warm-up, 20 timed) before its runs of 32.
    echo "== decode attention, batch 384, context 1500 =="
    ncu_run -k regex:paged_decode_mma --launch-skip 40 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        "$BIN/attention_bench" "decode batch 384, context 1500" 2>&1 | tee "$OUT/decode-attention.txt" |
        grep -v "^==PROF==" | head -150
fi

if [ "${BATCH:-1}" = 1 ]; then
    python3 -c 'import json, sys
c = json.load(open("bench-configs/llama-3.1-8b.json")); c["num_hidden_layers"] = 4
json.dump(c, open(sys.argv[1], "w"))' "$OUT/llama-8b-4-layers.json"
    # 384 prompts of 1500 in 9 steps of 65536 tokens (~470 launches), then decode steps of all 384
    # until the first requests finish after 16 tokens.
    batch_run() { # ncu arguments...
        ncu_run --metrics gpu__time_duration.sum --csv --page raw "$@" "$BIN/ferrolm" bench throughput \
            --model-config "$OUT/llama-8b-4-layers.json" --dummy-weights --device cuda --num-prompts 384 \
            --input-len 1500 --output-len 16 --max-num-seqs 384 --max-num-batched-tokens 65536 \
            >"$OUT/batch.log" 2>&1 || tail -n 5 "$OUT/batch.log"
    }
    FERROLM_CUDA_GRAPHS=0 batch_run --launch-skip 600 --launch-count 160 --log-file "$OUT/batch-eager.csv"
    echo "== llama-3.1-8b x 4 layers: one decode step of 384 at ~1500, kernel by kernel =="
    python3 tools/ncu_summary.py "$OUT/batch-eager.csv" --one-step "(3072, 1, 1)" --top 20 | tee "$OUT/batch-eager.txt"
    batch_run --graph-profiling graph --launch-skip 380 --launch-count 120 --log-file "$OUT/batch-graph.csv"
    batch_run --graph-profiling node --launch-skip 470 --launch-count 150 --log-file "$OUT/batch-node.csv"
    echo "== the same step as a graph (each replay one workload), then its kernels one by one =="
    python3 - "$OUT/batch-graph.csv" "$OUT/batch-node.csv" <<'PY'
import csv, sys
def rows(path):
    lines = [l for l in open(path) if l.startswith('"')]
    r = list(csv.reader(lines))
    name, time = r[0].index("Kernel Name"), r[0].index("gpu__time_duration.sum")
    return [(x[name], float(x[time].replace(",", "")) / 1e3) for x in r[2:]]
graphs = [t for n, t in rows(sys.argv[1]) if n == "graph" and t > 1000]
print("graph replays (us):", " ".join(f"{t:.0f}" for t in graphs))
node = rows(sys.argv[2])
ends = [i for i, (n, _) in enumerate(node) if "sample_rows" in n]
for a, b in zip(ends, ends[1:]):
    print(f"step of {b - a} kernels one by one: {sum(t for _, t in node[a + 1:b + 1]):.0f} us")
PY
fi
