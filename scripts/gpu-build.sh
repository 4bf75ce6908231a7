#!/usr/bin/env bash
# Builds, on a machine without CUDA, what scripts/gpu-check.sh runs on the GPU machine: the
# release binary with the CUDA backend and the GPU test binaries, stripped, into one folder.
#
#   scripts/gpu-build.sh [DEST]      (default .device-carry)
set -euo pipefail
DEST=${1:-.device-carry}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
mkdir -p "$DEST"
cargo build --release --locked -p ferrolm --features cuda
cp "$CARGO_TARGET_DIR/release/ferrolm" "$DEST/ferrolm"
# The test binaries: cargo prints each one's path as JSON; take the newest per name.
for spec in "ferrolm-backend cuda,bench-internals cuda_ops" "ferrolm-model cuda runner" "ferrolm-model cuda fp8_quality"; do
    set -- $spec
    path=$(cargo test --release --locked -p "$1" --features "$2" --test "$3" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$3" | tail -n 1)
    cp "$path" "$DEST/$3"
done
# The attention, GEMV and element-wise kernels on their own, and a step split over two streams (see crates/ferrolm-backend/examples/).
for example in attention_bench gemv_bench elementwise_bench overlap_bench; do
    cargo build --release --locked -p ferrolm-backend --features cuda,bench-internals --example "$example"
    cp "$CARGO_TARGET_DIR/release/examples/$example" "$DEST/$example"
done
strip "$DEST"/ferrolm "$DEST"/cuda_ops "$DEST"/runner "$DEST"/fp8_quality "$DEST"/attention_bench "$DEST"/gemv_bench "$DEST"/elementwise_bench "$DEST"/overlap_bench
# The revision the binaries were built from (the bench JSON records it; see gpu-check.sh).
git describe --always --dirty >"$DEST/REVISION"
ls -la "$DEST"
