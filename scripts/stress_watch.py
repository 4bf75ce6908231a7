"""The watchers of scripts/stress.py: `/health` polled on a fresh connection, the server's RSS sampled.

A probe starts every interval whether or not the one before has answered (as a load balancer's
would), so a server that stalls shows as the time each probe waited; a failed probe counts with
the time it took to fail. Samples are labelled with the phase running when they were taken.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from stress_http import close, describe, timed


@dataclass
class Probe:
    phase: str
    at_s: float
    latency_ms: float
    ok: bool
    error: str | None = None


class Watch:
    """Polls /health and samples the server's RSS until stopped; labels samples by phase."""

    def __init__(self, args: argparse.Namespace, port: int, pid: int):
        self.args, self.port, self.pid = args, port, pid
        self.phase = "start"
        self.t0 = time.monotonic()
        self.probes: list[Probe] = []
        self.rss: list[tuple[str, float, float]] = []  # (phase, at_s, rss_mb)
        self.min_available_mb: float | None = None
        self.low_memory = asyncio.Event()
        self.low_memory_at: tuple[str, float, float] | None = None  # (phase, at_s, available_mb)
        self._tasks: list[asyncio.Task] = []
        self._probes_in_flight: set[asyncio.Task] = set()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._poll_health()), asyncio.create_task(self._sample_memory())]

    async def stop(self) -> None:
        """Stops polling and sampling; the probes in flight end by their own timeout."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._probes_in_flight, return_exceptions=True)

    async def _poll_health(self) -> None:
        interval = self.args.health_interval_ms / 1000
        next_at = time.monotonic()
        while True:
            task = asyncio.create_task(self._probe(self.phase))
            self._probes_in_flight.add(task)
            task.add_done_callback(self._probes_in_flight.discard)
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # late (the client itself starved): skip ticks, do not burst
                next_at = now + interval
            await asyncio.sleep(next_at - now)

    async def _probe(self, phase: str) -> None:
        t0 = time.monotonic()
        writer = None
        ok, error = False, None
        try:
            async def once():
                nonlocal writer
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: ferrolm\r\nConnection: close\r\n\r\n")
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                return head.split(b" ", 2)[1] == b"200"

            ok = await timed(once(), self.args.health_timeout_s)
            if not ok:
                error = "status not 200"
        except asyncio.CancelledError:
            error = "unanswered when the run ended"
        except Exception as err:  # noqa: BLE001 - every failure is a figure
            error = describe(err)
        finally:
            close(writer)
        self.probes.append(Probe(phase, t0 - self.t0, (time.monotonic() - t0) * 1000, ok, error))

    async def _sample_memory(self) -> None:
        while True:
            rss = read_kb(f"/proc/{self.pid}/status", "VmRSS:")
            if rss is not None:
                self.rss.append((self.phase, time.monotonic() - self.t0, rss / 1024))
            available = read_kb("/proc/meminfo", "MemAvailable:")
            if available is not None:
                available_mb = available / 1024
                if self.min_available_mb is None or available_mb < self.min_available_mb:
                    self.min_available_mb = available_mb
                if available_mb < self.args.min_available_mb and not self.low_memory.is_set():
                    self.low_memory_at = (self.phase, time.monotonic() - self.t0, available_mb)
                    self.low_memory.set()
            await asyncio.sleep(self.args.rss_interval_ms / 1000)

    def rss_now_mb(self) -> float | None:
        rss = read_kb(f"/proc/{self.pid}/status", "VmRSS:")
        return None if rss is None else rss / 1024

    def hwm_mb(self) -> float | None:
        hwm = read_kb(f"/proc/{self.pid}/status", "VmHWM:")
        return None if hwm is None else hwm / 1024


def read_kb(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
