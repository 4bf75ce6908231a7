"""Raw HTTP/1.1 over asyncio streams for scripts/stress.py, with a timeout on every socket operation.

Every wait is bounded: by an explicit number of seconds, or by a [`Deadline`] that the whole request
shares, so that a server that stops answering never hangs the caller.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


class Deadline:
    """A point in time that bounds every wait of one request."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


async def timed(aw, seconds: float):
    return await asyncio.wait_for(aw, timeout=max(seconds, 0.001))


@dataclass
class Head:
    status: int
    headers: dict[str, str]


async def read_head(reader: asyncio.StreamReader, seconds: float) -> Head:
    raw = await timed(reader.readuntil(b"\r\n\r\n"), seconds)
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ValueError(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return Head(int(parts[1]), headers)


async def iter_body(reader: asyncio.StreamReader, head: Head, deadline: Deadline):
    """Yields the body's bytes as they arrive (chunked, Content-Length or up to EOF)."""
    if "chunked" in head.headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await timed(reader.readline(), deadline.left())
            if not size_line:
                raise ConnectionError("connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                return
            chunk = await timed(reader.readexactly(size + 2), deadline.left())
            yield chunk[:-2]
    elif "content-length" in head.headers:
        left = int(head.headers["content-length"])
        while left > 0:
            piece = await timed(reader.read(min(left, 1 << 20)), deadline.left())
            if not piece:
                raise ConnectionError(f"connection closed with {left} body bytes unread")
            left -= len(piece)
            yield piece
    else:
        while piece := await timed(reader.read(1 << 20), deadline.left()):
            yield piece


async def connect(port: int, seconds: float):
    return await timed(asyncio.open_connection("127.0.0.1", port, limit=1 << 20), seconds)


async def send_post(writer: asyncio.StreamWriter, path: str, body: bytes, seconds: float) -> None:
    head = (f"POST {path} HTTP/1.1\r\nHost: ferrolm\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    writer.write(head)
    for at in range(0, len(body), 1 << 20):
        writer.write(body[at:at + (1 << 20)])
        await timed(writer.drain(), seconds)
    await timed(writer.drain(), seconds)


def close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        try:
            writer.transport.abort()
        except Exception:  # noqa: BLE001 - closing a socket must never raise here
            pass


def describe(err: BaseException) -> str:
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    return f"{type(err).__name__}: {err}"[:200]
