#!/usr/bin/env python3
"""Load test of `ferrolm serve` under hostile clients (docs/RELIABILITY.md).

Starts `BINARY serve --port 0 --device cpu` with the bundled demo model, then runs two phases on
the same server:

- phase A: N concurrent streaming /v1/completions requests alone (the reference figures);
- phase B: the same N streams while, at the same time, clients send huge prompts, one request of
  many prompts x `n`, one request with thousands of long stop strings, and many connections hold
  a partial request head open.

Throughout, `/health` is polled on a fresh connection every 50 ms and the server's RSS is read
from /proc/PID/status every 100 ms. The checks are printed last as a table; the exit status is 0
only when every check passes. `--json FILE` writes every figure.

Python 3.11, standard library only: raw HTTP/1.1 over asyncio streams (stress_http.py), so that
it runs anywhere; the clients are in stress_clients.py, the watchers in stress_watch.py.
Invariants: every socket operation has a timeout (or is bounded by the phase deadline), each phase
is capped at --phase-timeout-s, and the server is killed on every way out of the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.dont_write_bytecode = True  # the sibling modules below leave no __pycache__ in the tree

from stress_clients import MODEL_NAME, HalfOpenStats, attack_bodies, hold_half_open, run_attack, run_stream, stream_body
from stress_http import Deadline, close, timed
from stress_watch import Probe, Watch, read_kb

REPO = Path(__file__).resolve().parent.parent
TTFT_RATIO_BOUND = 2.0  # phase B's p99 TTFT over phase A's
HEALTH_P99_BOUND_MS = 100.0
READY_MARK = "ferrolm: serving on http://"


# ---------------------------------------------------------------------------------------------
# Options


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Load test of `ferrolm serve`: streams alone, then the same streams under attack.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--binary", default=str(REPO / "target/release/ferrolm"), help="the ferrolm binary to run")
    p.add_argument("--model", default=str(REPO / "models" / MODEL_NAME), help="model directory")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `ferrolm serve` (repeat it)")
    p.add_argument("--server-log", default=str(Path(tempfile.gettempdir()) / "ferrolm-stress-server.log"),
                   help="where the server's stderr goes")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    g = p.add_argument_group("counts (the issue's numbers by default)")
    g.add_argument("--streams", type=int, default=200, help="concurrent streaming requests in each phase")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens each stream generates")
    g.add_argument("--big-prompts", type=int, default=4, help="clients sending one huge prompt each")
    g.add_argument("--big-prompt-mb", type=float, default=30.0, help="size of each huge prompt (MB of text)")
    g.add_argument("--fanout-prompts", type=int, default=1024, help="prompts in the many-prompts request")
    g.add_argument("--fanout-n", type=int, default=128, help="`n` of the many-prompts request")
    g.add_argument("--stop-strings", type=int, default=10_000, help="stop strings in the stop-strings request")
    g.add_argument("--stop-len", type=int, default=100, help="characters per stop string")
    g.add_argument("--stop-n", type=int, default=32, help="`n` of the stop-strings request")
    g.add_argument("--half-open", type=int, default=1000, help="connections holding a partial request head")
    g = p.add_argument_group("bounds and timing")
    g.add_argument("--rss-limit-mb", type=float, default=1024.0, help="the server's peak RSS must stay under this")
    g.add_argument("--phase-timeout-s", type=float, default=300.0, help="cap on each phase")
    g.add_argument("--attack-lead-s", type=float, default=1.0, help="phase B: attacks start this long before the streams")
    g.add_argument("--io-timeout-s", type=float, default=30.0, help="timeout of a connect or a write")
    g.add_argument("--health-interval-ms", type=float, default=50.0)
    g.add_argument("--health-timeout-s", type=float, default=5.0)
    g.add_argument("--rss-interval-ms", type=float, default=100.0)
    g.add_argument("--min-available-mb", type=float, default=3072.0,
                   help="stop the attack when the machine's MemAvailable falls below this")
    g.add_argument("--startup-timeout-s", type=float, default=120.0)
    g.add_argument("--shutdown-wait-s", type=float, default=10.0, help="after SIGTERM, wait this long, then SIGKILL")
    args = p.parse_args(argv)
    for name in ("streams", "max_tokens", "fanout_n", "stop_n"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# ---------------------------------------------------------------------------------------------
# Phases


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values, inf when it falls on a missing one."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


async def run_phase(name: str, args: argparse.Namespace, port: int, watch: Watch,
                    attacks: list[tuple[str, bytes]] | None) -> dict:
    watch.phase = name
    deadline = Deadline(args.phase_timeout_s)
    started = time.monotonic()
    stats = HalfOpenStats(args.half_open)
    held: list[asyncio.StreamWriter] = []
    attack_tasks: list[asyncio.Task] = []
    holders: list[asyncio.Task] = []
    if attacks is not None:
        attack_tasks = [asyncio.create_task(run_attack(n, b, port, args.io_timeout_s, deadline)) for n, b in attacks]
        gate = asyncio.Semaphore(200)
        holders = [asyncio.create_task(hold_half_open(port, stats, args.io_timeout_s, deadline, gate, held))
                   for _ in range(args.half_open)]
        await asyncio.sleep(args.attack_lead_s)
    stream_tasks = [asyncio.create_task(run_stream(i, port, stream_body(name, i, args.max_tokens), args.io_timeout_s,
                                                   deadline)) for i in range(args.streams)]
    low_memory = asyncio.create_task(watch.low_memory.wait())
    # The phase ends when every request has its answer; the half-open connections are held until then.
    everything = stream_tasks + attack_tasks
    all_done = asyncio.create_task(asyncio.wait(everything))
    await asyncio.wait([all_done, low_memory], timeout=deadline.left(), return_when=asyncio.FIRST_COMPLETED)
    ended_by = "all finished"
    if watch.low_memory.is_set():
        ended_by = f"stopped: machine MemAvailable under {args.min_available_mb:g} MB"
    elif not all_done.done():
        ended_by = f"capped at {args.phase_timeout_s:g} s"
    for task in everything + holders:
        task.cancel()
    await asyncio.gather(*everything, *holders, return_exceptions=True)
    all_done.cancel()
    low_memory.cancel()
    for writer in held:
        close(writer)
    phase_s = time.monotonic() - started
    streams = [t.result() for t in stream_tasks]
    attack_results = [t.result() for t in attack_tasks]
    await asyncio.sleep(2.0)  # let the server settle before reading its memory
    return summarize_phase(name, args, watch, streams, attack_results, stats if attacks is not None else None,
                           ended_by, phase_s)


def summarize_phase(name, args, watch, streams, attack_results, half_open, ended_by, phase_s) -> dict:
    ttfts = [r.ttft_s if r.ttft_s is not None else math.inf for r in streams]
    done_ttfts = [r.ttft_s for r in streams if r.ttft_s is not None and r.completed]
    totals = [r.total_s for r in streams if r.completed]
    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in streams:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        if r.error:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    rss = [mb for phase, _, mb in watch.rss if phase == name]
    return {
        "phase": name,
        "ended_by": ended_by,
        "duration_s": phase_s,
        "streams": len(streams),
        "completed": sum(r.completed for r in streams),
        "statuses": statuses,
        "errors": errors,
        "p50_ttft_ms": ms(percentile(ttfts, 50)),
        "p99_ttft_ms": ms(percentile(ttfts, 99)),
        "p99_ttft_completed_ms": ms(percentile(done_ttfts, 99)),
        "p50_total_ms": ms(percentile(totals, 50)),
        "p99_total_ms": ms(percentile(totals, 99)),
        "peak_rss_mb": max(rss) if rss else None,
        "rss_after_mb": watch.rss_now_mb(),
        "health": health_figures([p for p in watch.probes if p.phase == name]),
        "attacks": [asdict(a) for a in attack_results],
        "half_open": asdict(half_open) if half_open is not None else None,
        "stream_results": [asdict(r) | {"completed": r.completed} for r in streams],
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def health_figures(probes: list[Probe]) -> dict:
    # A failed probe counts with the time it took to fail (the timeout, for a server that hangs).
    latencies = [p.latency_ms for p in probes]
    return {
        "probes": len(probes),
        "failures": sum(not p.ok for p in probes),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else None,
        "failure_kinds": count_by([p.error or "" for p in probes if not p.ok]),
    }


def count_by(keys: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# The server process


def die_with_parent() -> None:
    """In the server's process: have Linux kill it if this script dies without stopping it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop_server still stops it on every way out but a kill -9


async def start_server(args: argparse.Namespace, log) -> tuple[asyncio.subprocess.Process, int]:
    cmd = [args.binary, "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
           "--model", args.model, *args.server_arg]
    print("starting:", " ".join(cmd), flush=True)
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log,
                                                stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = Deadline(args.startup_timeout_s)
    while True:
        try:
            line = await timed(proc.stdout.readline(), deadline.left())
        except (asyncio.TimeoutError, TimeoutError):
            proc.kill()
            raise RuntimeError(f"the server printed no {READY_MARK!r} within {args.startup_timeout_s:g} s")
        if not line:
            await proc.wait()
            raise RuntimeError(f"the server exited with status {proc.returncode} before serving "
                               f"(its log: {args.server_log})")
        text = line.decode("utf-8", "replace").strip()
        if READY_MARK in text:
            addr = text.split(READY_MARK, 1)[1]
            return proc, int(addr.rsplit(":", 1)[1].strip("/"))


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def stop_server(proc: asyncio.subprocess.Process, wait_s: float) -> dict:
    if proc.returncode is not None:
        return {"how": f"had exited with status {proc.returncode}", "seconds": 0.0}
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        await timed(proc.wait(), wait_s)
        return {"how": f"exited after SIGTERM with status {proc.returncode}", "seconds": time.monotonic() - t0}
    except (asyncio.TimeoutError, TimeoutError):
        proc.kill()
        await proc.wait()
        return {"how": f"still running {wait_s:g} s after SIGTERM: killed", "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------------------------------------
# Report


def jsonable(value):
    """`value` with infinities as the string "inf" (strict JSON has no Infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    total = read_kb("/proc/meminfo", "MemTotal:")
    return {"nproc": os.cpu_count(), "mem_total_gb": round(total / 1024 / 1024, 1) if total else None,
            "cpu": cpu, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def checks(args, a: dict | None, b: dict, peak_rss_mb: float | None, health: dict) -> list[dict]:
    rows = []
    for phase in (a, b):
        if phase is not None:
            rows.append({"check": f"phase {phase['phase']}: streams completed",
                         "value": f"{phase['completed']}/{phase['streams']}", "bound": f"{phase['streams']}",
                         "pass": phase["completed"] == phase["streams"]})
    if a is not None:
        pa, pb = a["p99_ttft_ms"], b["p99_ttft_ms"]
        ratio = pb / pa if pa not in (None, 0, math.inf) and pb is not None else math.inf
        rows.append({"check": "p99 TTFT, phase B / phase A", "value": f"{fmt(pb)} / {fmt(pa)} ms = {ratio:.2f}x",
                     "bound": f"<= {TTFT_RATIO_BOUND:g}x", "pass": ratio <= TTFT_RATIO_BOUND})
    rows.append({"check": "server peak RSS", "value": f"{fmt(peak_rss_mb)} MB",
                 "bound": f"< {args.rss_limit_mb:g} MB",
                 "pass": peak_rss_mb is not None and peak_rss_mb < args.rss_limit_mb})
    rows.append({"check": "/health p99 (both phases)", "value": f"{fmt(health['p99_ms'])} ms",
                 "bound": f"< {HEALTH_P99_BOUND_MS:g} ms",
                 "pass": health["p99_ms"] is not None and health["p99_ms"] < HEALTH_P99_BOUND_MS})
    return rows


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.1f}"
    return str(x)


def print_phase(p: dict) -> None:
    print(f"\nphase {p['phase']} ({p['ended_by']}, {p['duration_s']:.1f} s): "
          f"{p['completed']}/{p['streams']} streams completed; statuses {p['statuses']}")
    print(f"  TTFT p50 {fmt(p['p50_ttft_ms'])} ms, p99 {fmt(p['p99_ttft_ms'])} ms "
          f"(completed streams alone: p99 {fmt(p['p99_ttft_completed_ms'])} ms); "
          f"completion p50 {fmt(p['p50_total_ms'])} ms, p99 {fmt(p['p99_total_ms'])} ms")
    for err, count in p["errors"].items():
        print(f"  stream error x{count}: {err}")
    h = p["health"]
    print(f"  /health: {h['probes']} probes, {h['failures']} failed, p50 {fmt(h['p50_ms'])} ms, "
          f"p99 {fmt(h['p99_ms'])} ms, max {fmt(h['max_ms'])} ms")
    print(f"  server RSS: peak {fmt(p['peak_rss_mb'])} MB, 2 s after the phase {fmt(p['rss_after_mb'])} MB")
    for a in p["attacks"]:
        print(f"  attack {a['name']} ({a['request_bytes'] / 1e6:.1f} MB sent): status {fmt(a['status'])}, "
              f"head after {fmt(a['head_s'])} s, end after {fmt(a['total_s'])} s, "
              f"{a['response_bytes']} bytes back" + (f"; {a['error']}" if a["error"] else "")
              + (f"; body starts {a['response_start'][:120]!r}" if a["status"] not in (None, 200) else ""))
    if p["half_open"]:
        h = p["half_open"]
        print(f"  half-open: {h['opened']}/{h['wanted']} held open, {h['connect_failed']} failed to connect, "
              f"{h['closed_by_server']} closed by the server, {h['answered_by_server']} answered by it "
              f"(first after {fmt(h['first_close_s'])} s)")


def print_checks(rows: list[dict]) -> None:
    width = max(len(r["check"]) for r in rows)
    vwidth = max(len(r["value"]) for r in rows)
    print(f"\n{'check':<{width}}  {'value':<{vwidth}}  {'bound':<12}  result")
    for r in rows:
        print(f"{r['check']:<{width}}  {r['value']:<{vwidth}}  {r['bound']:<12}  {'pass' if r['pass'] else 'FAIL'}")


# ---------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    attacks = attack_bodies(args)
    report: dict = {"machine": machine(), "binary": args.binary, "options": vars(args)}
    with open(args.server_log, "wb") as log:
        proc, port = await start_server(args, log)
        drainer = asyncio.create_task(drain(proc.stdout))
        watch = Watch(args, port, proc.pid)
        try:
            watch.start()
            await asyncio.sleep(1.0)
            phase_a = await run_phase("A", args, port, watch, None)
            print_phase(phase_a)
            phase_b = await run_phase("B", args, port, watch, attacks)
            print_phase(phase_b)
            hwm = watch.hwm_mb()  # the kernel's own peak, between samples too
        finally:
            await watch.stop()
            report["shutdown"] = await stop_server(proc, args.shutdown_wait_s)
            drainer.cancel()
    sampled = [mb for _, _, mb in watch.rss]
    peak = max([*sampled, hwm] if hwm is not None else sampled, default=None)
    health = health_figures(watch.probes)
    rows = checks(args, phase_a, phase_b, peak, health)
    report |= {
        "phases": [phase_a, phase_b],
        "peak_rss_mb": peak, "peak_rss_sampled_mb": max(sampled, default=None), "vm_hwm_mb": hwm,
        "min_mem_available_mb": watch.min_available_mb,
        "low_memory_stop": watch.low_memory_at,
        "health": health,
        "health_probes": [asdict(p) for p in watch.probes],
        "rss_samples": watch.rss,
        "checks": rows,
        "passed": all(r["pass"] for r in rows),
    }
    print(f"\nserver: peak RSS {fmt(peak)} MB (VmHWM {fmt(hwm)} MB); shutdown: {report['shutdown']['how']} "
          f"in {report['shutdown']['seconds']:.1f} s; machine MemAvailable low point {fmt(watch.min_available_mb)} MB")
    print_checks(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(jsonable(report), f, indent=1)
        print(f"figures written to {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    options = parse_args(sys.argv[1:])
    try:
        sys.exit(asyncio.run(main(options)))
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as error:
        print(f"stress: {error}", file=sys.stderr)
        sys.exit(2)
