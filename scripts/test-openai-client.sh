#!/usr/bin/env bash
# Structured output and tool calls end to end with the official openai Python client
# (tests/openai_client/), against a ferrolm binary (default: the debug one that
# `cargo test --workspace` builds), in a venv of pinned packages under target/.
#
#   scripts/test-openai-client.sh [run.py args...]     (BINARY=path to choose the binary)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENAI_CLIENT_VENV:-$PWD/target/openai-client-venv}
BINARY=${BINARY:-${CARGO_TARGET_DIR:-target}/debug/ferrolm}
[ -x "$BINARY" ] || cargo build -p ferrolm
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/openai_client/requirements.txt
exec "$VENV/bin/python" tests/openai_client/run.py --binary "$BINARY" "$@"
