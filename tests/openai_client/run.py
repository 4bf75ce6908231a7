#!/usr/bin/env python3
"""End-to-end tests of structured output and tool calls with the official `openai` client.

Starts `BINARY serve` on a fixture model (testdata/fixtures: random weights, a chat template) on a
port the server picks, waits for /health, runs the test_*.py modules of this folder (unittest),
and stops the server. The server's stdout and stderr go to a log file, printed when a test fails
or the server dies.

    python3 tests/openai_client/run.py --binary target/debug/ferrolm [-k PATTERN]

Needs the packages of requirements.txt (openai, pydantic, jsonschema). Exit status 0 only when
every test passes; the last line reads `openai-client: N passed, M failed`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request
from pathlib import Path

sys.dont_write_bytecode = True  # the test modules leave no __pycache__ in the tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
READY_MARK = "ferrolm: serving on http://"
MODEL_NAME = "fixture"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--binary", default=str(REPO / "target/debug/ferrolm"), help="the ferrolm binary to run")
    p.add_argument("--model", default=str(REPO / "testdata/fixtures/llama"), help="model directory")
    p.add_argument("--log", help="where the server's output goes (default: a temporary file)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `ferrolm serve` (repeat it)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the server to become healthy")
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="only tests whose name matches this substring or glob (repeat it)")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    return p.parse_args(argv)


def max_model_len(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["max_position_embeddings"])


def wait_until_healthy(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    """The server's base URL, once it has printed its address and /health answers 200."""
    deadline = time.monotonic() + timeout
    base = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was healthy")
        if base is None:
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith(READY_MARK):
                    base = "http://" + line[len(READY_MARK):].strip()
        if base is not None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return base
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM, then SIGKILL after 30 s; the exit status (None when it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_tests(patterns: list[str], verbose: bool) -> unittest.TestResult:
    sys.path.insert(0, str(HERE))
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
    suite = loader.discover(str(HERE), pattern="test_*.py", top_level_dir=str(HERE))
    return unittest.TextTestRunner(stream=sys.stdout, verbosity=2 if verbose else 1).run(suite)


def failed_tests(result: unittest.TestResult) -> set[str]:
    """The ids of the tests that failed, a test with failed subtests counted once."""
    bad = [t for t, _ in result.failures + result.errors] + list(result.unexpectedSuccesses)
    return {getattr(t, "test_case", t).id() for t in bad}


def print_log(log_path: Path) -> None:
    print(f"\n---- server log ({log_path}) ----")
    print(log_path.read_text(errors="replace").rstrip())
    print("---- end of server log ----", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    binary, model = Path(args.binary), Path(args.model)
    if not binary.is_file():
        print(f"no binary at {binary}: build it (cargo build -p ferrolm) or pass --binary", file=sys.stderr)
        return 2
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="ferrolm-openai-client-", suffix=".log")[1])
    command = [str(binary), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
               "--device", "cpu", "--served-model-name", MODEL_NAME, *args.server_arg]
    print("starting:", " ".join(command), flush=True)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    result = None
    try:
        base = wait_until_healthy(proc, log_path, args.start_timeout)
        print(f"server healthy at {base} after {time.monotonic() - started:.1f} s; log: {log_path}", flush=True)
        os.environ.update({"FERROLM_BASE_URL": base, "FERROLM_MODEL_NAME": MODEL_NAME,
                           "FERROLM_MAX_MODEL_LEN": str(max_model_len(model))})
        result = run_tests(args.patterns, args.verbose)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
    finally:
        alive = proc.poll() is None
        status = stop(proc)
    failed = len(failed_tests(result)) if result else 1
    passed = (result.testsRun - failed - len(result.skipped)) if result else 0
    server_ok = alive and status == 0
    if not server_ok:
        print(f"the server {'died during the tests' if not alive else f'did not stop cleanly (status {status})'}")
    if failed or not server_ok:
        print_log(log_path)
    print(f"openai-client: {passed} passed, {failed} failed" + (f", {len(result.skipped)} skipped" if result and result.skipped else ""),
          flush=True)
    return 0 if failed == 0 and server_ok and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
