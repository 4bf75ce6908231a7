#!/usr/bin/env bash
# Two builds of ferrolm on the same GPU in one call, rows interleaved (base, new, base, new) so
# that the machine's drift falls on both: what a change gains. Builds nothing: NEW and BASE are
# folders holding a `ferrolm` built with --features cuda (scripts/gpu-build.sh DIR).
#
#   scripts/gpu-ab.sh NEW BASE [ROW...]
#
# ROWs (default: l1b l8b t1000-512): l1b, l8b (one request, 128 in / 256 out), l1b-nucleus,
# l8b-nucleus (the same at T = 0.6, top-p 0.9), ttft (the 8B's 2048-token prompt), d384 (the 8B
# decoding 384 requests at ~1500), t1000-512 (the 8B's 1000 x (1000 + 1000), 512 requests at a
# time in the whole free memory, as docs/PERFORMANCE.md gives the row; ~2.5 min a run), t1000
# (the same 384 at a time: three waves instead of two). BASE_ROW runs that row on the base side
# instead of each ROW, to compare flags on one build: `BASE_ROW=t1000 scripts/gpu-ab.sh DIR DIR
# t1000-512`.
# FP8 rows: l8b-fp8 and ttft-fp8 (the rows above with --quantization fp8), t1000-512-fp8 (with
# --kv-cache-dtype fp8 too). BASE_ROW=bf16 runs each row without its -fp8 on the base side, so that
# one build's FP8 rows meet its bf16 ones: `BASE_ROW=bf16 scripts/gpu-ab.sh DIR DIR l8b-fp8
# ttft-fp8 t1000-512-fp8`. t1000-768-fp8 and t1000-1000-fp8: the FP8 row with 768 or all 1000
# requests at a time (768 x 2000 tokens of FP8 cache fit on an H200, not on an H100, where both
# rows preempt); they have no bf16 row, so compare them with the 512 one:
# `BASE_ROW=t1000-512-fp8 scripts/gpu-ab.sh DIR DIR t1000-768-fp8 t1000-1000-fp8`.
# Qwen3-8B in FP8 at 64 requests of 512 + 256 (decode GEMMs of 64 rows): q8b-t64-fp8 (its bf16
# config with --quantization fp8: a scale a row) and q8b-t64-fp8blk (its FP8 checkpoint's config:
# 128 x 128 blocks, as Qwen3-8B-FP8 ships). The block GEMM against the dequantized copy, one
# build: `FERROLM_FP8_BLOCK_GEMM=0 NEW_ENV=FERROLM_FP8_BLOCK_GEMM=1 BASE_ROW=q8b-t64-fp8blk
# scripts/gpu-ab.sh DIR DIR q8b-t64-fp8blk`; against a scale a row: `BASE_ROW=q8b-t64-fp8
# scripts/gpu-ab.sh DIR DIR q8b-t64-fp8blk`.
# NEW_ENV ("NAME=VALUE ...") is set for the new side's runs only, to compare a switch on one
# build: `NEW_ENV=FERROLM_DECODE_TENSOR_COPIES=1 BASE_ROW=t1000-512 scripts/gpu-ab.sh DIR DIR
# t1000-512`.
# ROUNDS (default 2) runs per build and row. Logs and JSON go to $OUT (default: a new temporary
# directory); the table comes last.
set -u
NEW=${1:?usage: scripts/gpu-ab.sh NEW BASE [ROW...]}
BASE=${2:?usage: scripts/gpu-ab.sh NEW BASE [ROW...]}
shift 2
ROWS=("$@")
[ ${#ROWS[@]} -eq 0 ] && ROWS=(l1b l8b t1000-512)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
L1B=(--model-config bench-configs/llama-3.2-1b.json)
L8B=(--model-config bench-configs/llama-3.1-8b.json)
DECODE=(--input-len 128 --output-len 256 --num-iters 3)
Q30B=(--model-config bench-configs/qwen3-30b-a3b.json)

row_args() { # row -> the bench arguments
    case $1 in
        l1b) echo latency "${L1B[@]}" "${DECODE[@]}" ;;
        l8b) echo latency "${L8B[@]}" "${DECODE[@]}" ;;
        l1b-nucleus) echo latency "${L1B[@]}" "${DECODE[@]}" --temperature 0.6 --top-p 0.9 ;;
        l8b-nucleus) echo latency "${L8B[@]}" "${DECODE[@]}" --temperature 0.6 --top-p 0.9 ;;
        ttft) echo latency "${L8B[@]}" --input-len 2048 --output-len 1 --num-iters 5 --max-num-batched-tokens 4096 ;;
        d384) echo throughput "${L8B[@]}" --num-prompts 384 --input-len 1500 --output-len 256 --max-num-seqs 384 \
            --max-num-batched-tokens 8192 ;;
        t1000) echo throughput "${L8B[@]}" --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-seqs 384 \
            --max-num-batched-tokens 8192 ;;
        t1000-512) echo throughput "${L8B[@]}" --num-prompts 1000 --input-len 1000 --output-len 1000 \
            --max-num-seqs 512 --max-num-batched-tokens 8192 --kv-cache-fraction 1.0 ;;
        l8b-fp8) echo latency "${L8B[@]}" "${DECODE[@]}" --quantization fp8 ;;
        ttft-fp8) echo "$(row_args ttft)" --quantization fp8 ;;
        t1000-512-fp8) echo "$(row_args t1000-512)" --quantization fp8 --kv-cache-dtype fp8 ;;
        t1000-768-fp8 | t1000-1000-fp8) n=${1#t1000-}; echo throughput "${L8B[@]}" --num-prompts 1000 --input-len 1000 \
            --output-len 1000 --max-num-seqs "${n%-fp8}" --max-num-batched-tokens 8192 --kv-cache-fraction 1.0 \
            --quantization fp8 --kv-cache-dtype fp8 ;;
        q8b-t64-fp8 | q8b-t64-fp8blk) config=qwen3-8b; quant=(--quantization fp8)
            [ "$1" = q8b-t64-fp8blk ] && config=qwen3-8b-fp8 quant=()
            echo throughput --model-config "bench-configs/$config.json" --num-prompts 64 --input-len 512 \
                --output-len 256 --max-num-seqs 64 --max-num-batched-tokens 8192 "${quant[@]}" ;;
        q30b) echo latency "${Q30B[@]}" "${DECODE[@]}" ;;
        mixtral) echo latency --model-config bench-configs/mixtral-8x7b.json "${DECODE[@]}" ;;
        gemma2) echo latency --model-config bench-configs/gemma-2-9b.json "${DECODE[@]}" ;;
        gemma3) echo latency --model-config bench-configs/gemma-3-1b.json "${DECODE[@]}" ;;
        q30b-t1000) echo throughput "${Q30B[@]}" --num-prompts 1000 --input-len 1000 --output-len 1000 \
            --max-num-seqs 512 --max-num-batched-tokens 8192 --kv-cache-fraction 1.0 ;;
        *) echo "unknown row $1" >&2; return 1 ;;
    esac
}

# The row's figure from its JSON: TTFT p50 (ms) for ttft, the mean decode step (ms) for d384
# (lower is better for both), output tokens/s otherwise.
figure() { # row json
    python3 - "$1" "$2" <<'PY'
import json, sys
row, path = sys.argv[1], sys.argv[2]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    print("failed"); sys.exit()
key = {"ttft": "median_ttft_ms", "d384": "mean_decode_step_ms"}.get(row.removesuffix("-fp8"), "output_throughput")
print(f"{r[key]:.2f}")
PY
}

declare -A results
for row in "${ROWS[@]}"; do
    new_args=$(row_args "$row") || exit 2
    base_row=${BASE_ROW:-$row}
    [ "$base_row" = bf16 ] && base_row=${row%-fp8}
    base_args=$(row_args "$base_row") || exit 2
    for round in $(seq "${ROUNDS:-2}"); do
        for side in base new; do
            dir=$BASE args=$base_args envs=()
            if [ "$side" = new ]; then
                dir=$NEW args=$new_args
                read -r -a envs <<<"${NEW_ENV:-}"
            fi
            json="$OUT/$row-$side-$round.json"
            # The JSON names the build's revision (gpu-build.sh writes it), not this checkout's.
            revision=$(cat "$dir/REVISION" 2>/dev/null || true)
            # shellcheck disable=SC2086 # the row's arguments are words
            env "${envs[@]}" FERROLM_GIT_REVISION="$revision" timeout "${BENCH_TIMEOUT:-420}" "$dir/ferrolm" bench $args --device cuda \
                --dummy-weights --json "$json" >"$json.log" 2>&1 || tail -n 3 "$json.log"
            results[$row,$side]="${results[$row,$side]:-} $(figure "$row" "$json")"
            echo "$row $side round $round: $(figure "$row" "$json")"
        done
    done
done

echo
echo "=== ferrolm A/B: $NEW${NEW_ENV:+ with $NEW_ENV} against $BASE${BASE_ROW:+ (base side: row $BASE_ROW)} ($(date -u +%FT%TZ)) ==="
printf '%-12s %-6s %-24s %-24s %s\n' row unit base new "new / base (means)"
for row in "${ROWS[@]}"; do
    python3 - "$row" "${results[$row,base]}" "${results[$row,new]}" <<'PY'
import sys
row, base, new = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def mean(xs):
    v = [float(x) for x in xs if x != "failed"]
    return sum(v) / len(v) if v else None
b, n = mean(base), mean(new)
ratio = f"{n / b:.3f}" if b and n else "-"
unit = "ms" if row.removesuffix("-fp8") in ("ttft", "d384") else "tok/s"
print(f"{row:<12} {unit:<6} {' '.join(base):<24} {' '.join(new):<24} {ratio}")
PY
done
