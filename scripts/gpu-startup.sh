#!/usr/bin/env bash
# Start-up time of `ferrolm serve` on the GPU machine: seconds from the command to the first
# answer of /health, for two builds, each with an empty kernel cache (a container's first start)
# and then with the cache it left (a restart). Builds nothing: NEW and BASE are folders holding a
# `ferrolm` built with --features cuda (scripts/gpu-build.sh DIR).
#
#   scripts/gpu-startup.sh NEW BASE [ROUNDS]
#
# The model is an 8B-shaped directory (bench-configs/llama-3.1-8b.json, 4 bf16 shards of random
# weights, written here once and so in the page cache; the demo model's tokenizer). Each start's
# log (RUST_LOG=info) goes to $OUT and its timing lines are printed: where the seconds go.
set -u
NEW=${1:?usage: scripts/gpu-startup.sh NEW BASE [ROUNDS]}
BASE=${2:?usage: scripts/gpu-startup.sh NEW BASE [ROUNDS]}
ROUNDS=${3:-1}
OUT=${OUT:-$(mktemp -d)}
MODEL=${MODEL_DIR:-/tmp/ferrolm-8b-shaped}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export RUST_LOG=${RUST_LOG:-info}

if [ ! -f "$MODEL/model.safetensors.index.json" ]; then
    mkdir -p "$MODEL"
    cp bench-configs/llama-3.1-8b.json "$MODEL/config.json"
    cp models/ferrolm-demo-py/tokenizer.json models/ferrolm-demo-py/tokenizer_config.json "$MODEL/"
    python3 - "$MODEL" <<'PY'
import json, sys, torch
from safetensors.torch import save_file
d = sys.argv[1]
c = json.load(open(f"{d}/config.json"))
h, i, v, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
for l in range(L):
    p = f"model.layers.{l}"
    shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, h),
                   f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                   f"{p}.mlp.down_proj.weight": (h, i)})
names = list(shapes)
shards, weight_map = 4, {}
for s in range(shards):
    part = names[s::shards]
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    tensors = {n: (torch.randn(shapes[n], device="cuda", dtype=torch.bfloat16) * 0.02).cpu() for n in part}
    save_file(tensors, f"{d}/{file}")
    weight_map.update({n: file for n in part})
json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{d}/model.safetensors.index.json", "w"))
PY
    cat "$MODEL"/*.safetensors >/dev/null
fi
du -sh "$MODEL"

declare -A results
port=8100
for round in $(seq "$ROUNDS"); do
    for side in base new; do
        dir=$BASE
        [ "$side" = new ] && dir=$NEW
        cache=$(mktemp -d)
        for start in first cached; do
            port=$((port + 1))
            log="$OUT/startup-$side-$start-$round.log"
            t0=$(date +%s.%N)
            XDG_CACHE_HOME=$cache "$dir/ferrolm" serve --model "$MODEL" --device cuda --port $port >"$log" 2>&1 &
            pid=$!
            seconds=failed
            for _ in $(seq 1800); do
                if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
                    seconds=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
                    break
                fi
                kill -0 $pid 2>/dev/null || break
                sleep 0.1
            done
            kill $pid 2>/dev/null
            wait $pid 2>/dev/null
            results[$side,$start]="${results[$side,$start]:-} $seconds"
            echo "$side $start start, round $round: $seconds s"
            grep -aE "seconds|kernels ready|tuned|placed|uploaded|captured" "$log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220 | head -12
        done
        rm -rf "$cache"
    done
done

echo
echo "=== ferrolm serve start-up (s to /health), 8B-shaped bf16 directory: $NEW against $BASE ($(date -u +%FT%TZ)) ==="
printf '%-8s %-16s %-16s\n' start base new
for start in first cached; do
    printf '%-8s %-16s %-16s\n' "$start" "${results[base,$start]}" "${results[new,$start]}"
done
