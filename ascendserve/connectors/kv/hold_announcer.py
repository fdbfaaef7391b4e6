"""P's scheduler tells its own workers of a hold the moment the request finished.

The scheduler learns that a prefill finished (request_finished) and answers
the client at once, so D may ask P's worker for the pages a moment later.
The worker learns of the hold only from the metadata of the engine's next
step, and under vLLM's async scheduling (its default) that step is queued
behind the one already running: a long prefill keeps D waiting for its
whole length (9 s per wave at P TP=2 here, before this existed). So the
scheduler also sends HOLD over each local rank's side channel (a control
session, the cluster token) from a thread of its own; the worker registers
whichever arrives first (pull_worker.py).

Best effort and never on the scheduler's path: announce() only queues, a
rank that cannot be reached is skipped for RETRY_S, and anything lost is
registered by the step as before.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time

import structlog

from ascendserve.protocol.frames import FrameError, read_frame, send_frame

log = structlog.get_logger("ascendserve.kv.hold")
MAX_QUEUED = 4096  # beyond it announcements are dropped (the step registers them)
RETRY_S = 1.0  # after a rank could not be reached, skip it this long
REFUSED_RETRY_S = 60.0  # after a rank refused a HOLD (it names why, once), skip it this long
IO_TIMEOUT_S = 2.0


def local_host(bind_host: str) -> str:
    """Where this host's side channels are reached: the bound address, loopback for a wildcard."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::") else bind_host


def _closed(sock: socket.socket) -> tuple[bool, str | None]:
    """(closed, why refused). The server never answers a HOLD: anything readable is its close
    (idle timeout: no reason) or a refusal (an ERR frame naming why)."""
    poller = select.poll()  # not select.select: an engine core may hold descriptors past FD_SETSIZE
    try:
        poller.register(sock, select.POLLIN)
        ready = poller.poll(0)
    except (OSError, ValueError):
        return True, None
    if not ready:
        return False, None
    try:
        sock.settimeout(0.1)
        answer = read_frame(sock, 0)
    except (OSError, FrameError):
        return True, None
    return True, str(answer.get("reason")) if answer.get("type") == "ERR" else None


class HoldAnnouncer:
    def __init__(self, host: str, port: int, ranks: int, token: str):
        self.host, self.port, self.ranks, self.token = host, port, ranks, token
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._socks: dict[int, socket.socket] = {}
        self._down_until: dict[int, float] = {}
        self.sent = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-hold-announcer", daemon=True)
        self._thread.start()

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float) -> None:
        """Queue a HOLD for every rank; returns at once."""
        if self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.put({"type": "HOLD", "request_id": request_id, "blocks": list(block_ids),
                         "ttl_s": float(ttl_s), "at": time.time()})

    def close(self, timeout_s: float = 1.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while (msg := self._queue.get()) is not None:
                for rank in range(self.ranks):
                    self._send(rank, msg)
        finally:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()

    def _send(self, rank: int, msg: dict) -> None:
        sock = self._socks.get(rank)
        if sock is not None:
            closed, refused = _closed(sock)
            if closed:
                sock.close()
                self._socks.pop(rank, None)
                sock = None
            if refused:
                self._down_until[rank] = time.monotonic() + REFUSED_RETRY_S
                log.warning("KV hold announcements refused by the side channel; the engine's steps register "
                            "the holds instead", peer=f"{self.host}:{self.port + rank}", reason=refused)
        if sock is None:
            sock = self._connect(rank)
            if sock is None:
                self.dropped += 1
                return
        try:
            send_frame(sock, msg)
            self.sent += 1
        except OSError:
            sock.close()
            self._socks.pop(rank, None)
            self.dropped += 1

    def _connect(self, rank: int) -> socket.socket | None:
        if time.monotonic() < self._down_until.get(rank, 0.0):
            return None
        port = self.port + rank
        try:
            sock = socket.create_connection((self.host, port), timeout=IO_TIMEOUT_S)
        except OSError as exc:
            self._down_until[rank] = time.monotonic() + RETRY_S
            log.debug("KV hold announcements: side channel unreachable", peer=f"{self.host}:{port}", error=str(exc))
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IO_TIMEOUT_S)
            send_frame(sock, {"type": "HELLO", "token": self.token})
            answer = read_frame(sock, 0)
        except (OSError, FrameError) as exc:
            answer = {"type": "ERR", "reason": str(exc)}
        if answer.get("type") != "OK":
            sock.close()
            self._down_until[rank] = time.monotonic() + RETRY_S
            log.warning("KV hold announcements refused by the side channel", peer=f"{self.host}:{port}",
                        reason=answer.get("reason"))
            return None
        self._socks[rank] = sock
        return sock
