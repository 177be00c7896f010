"""A user-space network emulator: a TCP proxy that delays the real bytes of a link.

Kernel netem is not available on these machines, so the coordinator can put one of these in
front of each service. Every chunk read from one side is written to the other after the
link's one-way delay (half the added round-trip time) plus Gaussian jitter, in order, and no
faster than the bandwidth cap allows. gRPC runs over it unchanged.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass


@dataclass
class LinkSettings:
    rtt_ms: float = 0.0  # added round-trip time, split evenly between the two directions
    jitter_ms: float = 0.0  # standard deviation of each direction's delay
    bandwidth_mbps: float = 0.0  # cap in each direction; 0 = unlimited

    def __post_init__(self) -> None:  # checked wherever settings are made: a config, a bench's sweep, a test
        for name in ("rtt_ms", "jitter_ms", "bandwidth_mbps"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def active(self) -> bool:
        return self.rtt_ms > 0 or self.jitter_ms > 0 or self.bandwidth_mbps > 0


class LatencyProxy:
    """Listens on localhost and forwards every connection to `target` (host:port) through a
    delayed pipe in each direction. The settings may be changed while it runs."""

    def __init__(self, target: str, settings: LinkSettings, seed: int = 0):
        self.target_host, target_port = target.rsplit(":", 1)
        self.target_port = int(target_port)
        self.settings = settings
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name=f"latency-proxy->{target}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.address = f"localhost:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._connect, "localhost", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _connect(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer), return_exceptions=True
        )

    def _delay_s(self) -> float:
        s = self.settings
        return max(0.0, self._random.gauss(s.rtt_ms / 2, s.jitter_ms) if s.jitter_ms else s.rtt_ms / 2) / 1e3

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Reads as fast as the sender writes; delivers each chunk at its due time, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        last_due = 0.0

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
            writer.close()

        delivery = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await reader.read(1 << 16)
                now = time.perf_counter()
                if not chunk:
                    break
                bandwidth = self.settings.bandwidth_mbps
                on_wire = len(chunk) * 8 / (bandwidth * 1e6) if bandwidth > 0 else 0.0
                # In order: a chunk never overtakes the one before it, and a capped link
                # carries one chunk after another.
                last_due = max(now + self._delay_s(), last_due) + on_wire
                queue.put_nowait((last_due, chunk))
        finally:
            queue.put_nowait((0.0, b""))
            await delivery

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(5)
