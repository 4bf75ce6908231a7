"""The clients of scripts/stress.py: the measured streams, the attacking requests, half-open connections.

Each client returns a result record whatever happens (an HTTP error, a timeout, the phase cap
cancelling it): a failure is a figure, never an exception out of the phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from stress_http import Deadline, close, connect, describe, iter_body, read_head, send_post, timed

MODEL_NAME = "ferrolm-demo-py"
# The start of a request head that never ends: the server waits for the rest of it.
HALF_OPEN_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: ferrolm\r\nContent-Type: application/json\r\nContent-Len"
SNIPPET = (
    "def merge_sorted(left, right):\n"
    "    out = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            out.append(left[i]); i += 1\n"
    "        else:\n"
    "            out.append(right[j]); j += 1\n"
    "    return out + left[i:] + right[j:]\n\n"
)


@dataclass
class StreamResult:
    index: int
    status: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None and self.error is None


def stream_body(phase: str, index: int, max_tokens: int) -> bytes:
    # The phase and index lead the prompt, so no stream reuses another's KV blocks (prefix cache).
    prompt = f"# example {phase}{index}\n{SNIPPET}def "
    return json.dumps({
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()


async def run_stream(index: int, port: int, body: bytes, io_s: float, deadline: Deadline) -> StreamResult:
    res = StreamResult(index)
    t0 = time.monotonic()
    writer = None
    try:
        reader, writer = await connect(port, min(io_s, deadline.left()))
        await send_post(writer, "/v1/completions", body, min(io_s, deadline.left()))
        head = await read_head(reader, deadline.left())
        res.status = head.status
        pending = b""
        async for piece in iter_body(reader, head, deadline):
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                handle_sse_line(res, line, t0)
        for line in pending.split(b"\n"):
            handle_sse_line(res, line, t0)
        if head.status != 200 and res.error is None:
            res.error = f"HTTP {head.status}"
    except asyncio.CancelledError:
        res.error = "not finished at the phase cap"
    except Exception as err:  # noqa: BLE001 - every failure is a figure
        res.error = describe(err)
    finally:
        close(writer)
    res.total_s = time.monotonic() - t0
    return res


def handle_sse_line(res: StreamResult, line: bytes, t0: float) -> None:
    line = line.strip()
    if not line.startswith(b"data:"):
        if line.startswith(b"{") and res.error is None:  # a non-streamed error body
            res.error = line.decode("utf-8", "replace")[:200]
        return
    data = line[5:].strip()
    if data == b"[DONE]":
        res.done = True
        return
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        res.error = f"bad SSE data {data[:80]!r}"
        return
    if "error" in obj:
        res.error = json.dumps(obj["error"])[:200]
    for choice in obj.get("choices") or []:
        if res.ttft_s is None:
            res.ttft_s = time.monotonic() - t0
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    if obj.get("usage"):
        res.completion_tokens = obj["usage"].get("completion_tokens")


# ---------------------------------------------------------------------------------------------
# The attackers


@dataclass
class AttackResult:
    name: str
    request_bytes: int
    status: int | None = None
    head_s: float | None = None
    total_s: float | None = None
    response_bytes: int = 0
    response_start: str = ""
    error: str | None = None


def attack_bodies(args: argparse.Namespace) -> list[tuple[str, bytes]]:
    """(name, request body) of each attacking request, built before the phase starts."""
    bodies = []
    if args.big_prompts > 0:
        size = int(args.big_prompt_mb * 1_000_000)
        text = (SNIPPET * (size // len(SNIPPET) + 1))[:size]
        big = json.dumps({"model": MODEL_NAME, "prompt": text, "max_tokens": 16}).encode()
        bodies += [(f"{args.big_prompt_mb:g} MB prompt #{i + 1}", big) for i in range(args.big_prompts)]
    if args.fanout_prompts > 0:
        prompts = [f"# task {i}\n{SNIPPET[:180]}" for i in range(args.fanout_prompts)]
        body = json.dumps({"model": MODEL_NAME, "prompt": prompts, "n": args.fanout_n, "max_tokens": 16,
                           "temperature": 1.0}).encode()
        bodies.append((f"{args.fanout_prompts} prompts x n {args.fanout_n}", body))
    if args.stop_strings > 0:
        rng = random.Random(32)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        stops = ["".join(rng.choices(letters, k=args.stop_len)) for _ in range(args.stop_strings)]
        body = json.dumps({"model": MODEL_NAME, "prompt": SNIPPET, "n": args.stop_n, "max_tokens": 128,
                           "temperature": 1.0, "stop": stops}).encode()
        bodies.append((f"{args.stop_strings} stop strings of {args.stop_len} chars x n {args.stop_n}", body))
    return bodies


async def run_attack(name: str, body: bytes, port: int, io_s: float, deadline: Deadline) -> AttackResult:
    res = AttackResult(name, len(body))
    t0 = time.monotonic()
    writer = None
    try:
        reader, writer = await connect(port, min(io_s, deadline.left()))
        try:
            await send_post(writer, "/v1/completions", body, min(io_s, deadline.left()))
        except (ConnectionError, OSError) as err:
            # A server may answer (413, 400) and close before the whole body is sent.
            res.error = f"while sending: {describe(err)}"
        head = await read_head(reader, deadline.left())
        res.status, res.head_s = head.status, time.monotonic() - t0
        async for piece in iter_body(reader, head, deadline):
            if len(res.response_start) < 300:
                res.response_start += piece[:300].decode("utf-8", "replace")
            res.response_bytes += len(piece)
    except asyncio.CancelledError:
        res.error = "no response by the phase cap" if res.status is None else "response unfinished at the phase cap"
    except Exception as err:  # noqa: BLE001 - every failure is a figure
        res.error = describe(err)
    finally:
        close(writer)
    res.total_s = time.monotonic() - t0
    res.response_start = res.response_start[:300]
    return res


@dataclass
class HalfOpenStats:
    wanted: int
    opened: int = 0
    connect_failed: int = 0
    closed_by_server: int = 0
    answered_by_server: int = 0
    first_close_s: float | None = None
    connect_errors: dict[str, int] = field(default_factory=dict)


async def hold_half_open(port: int, stats: HalfOpenStats, io_s: float, deadline: Deadline,
                         gate: asyncio.Semaphore, writers: list) -> None:
    """Opens a connection, sends part of a request head and holds it until the phase ends."""
    t0 = time.monotonic()
    try:
        async with gate:
            reader, writer = await connect(port, min(io_s, deadline.left()))
            writers.append(writer)
            writer.write(HALF_OPEN_HEAD)
            await timed(writer.drain(), min(io_s, deadline.left()))
        stats.opened += 1
    except asyncio.CancelledError:
        return
    except Exception as err:  # noqa: BLE001 - every failure is a figure
        stats.connect_failed += 1
        key = describe(err)
        stats.connect_errors[key] = stats.connect_errors.get(key, 0) + 1
        return
    try:
        data = await timed(reader.read(4096), deadline.left())
    except (asyncio.CancelledError, asyncio.TimeoutError, TimeoutError):
        return  # still held: the phase ended first
    except (ConnectionError, OSError):
        data = b""
    if data:
        stats.answered_by_server += 1
    else:
        stats.closed_by_server += 1
    closed_s = time.monotonic() - t0
    stats.first_close_s = closed_s if stats.first_close_s is None else min(stats.first_close_s, closed_s)


