"""The NetLoader seed: streams a model's weights to joining instances over TCP.

Conversation (ascendserve.protocol.frames, msgpack headers, raw payloads):

    joiner -> JOIN {version, token, identity, stream, tp_rank, tp_size, pp_rank, pp_size}
    seed   -> JOIN_ACK {version, identity, total_bytes} + payload: the manifest, msgpack
                  [{name, dtype, shape, nbytes, crc32c}] (any size up to wire.MAX_MANIFEST_BYTES)
            | JOIN_NACK {reason}                      (then closes)
    joiner -> GET {part, parts}
    seed   -> TENSOR {index, name, offset} + payload, for every chunk of part `part` (wire.plan), in order
    seed   -> DONE {}

A joiner may open up to wire.MAX_STREAMS connections for one transfer, each a
JOIN of its own (`stream`: 0, 1, ...) taking a transfer slot (further streams
only while a quarter of the slots stay free): connection j asks for part j
of `parts`, a contiguous byte range of the tensors laid end to end (a tensor
may be split between two parts; `offset` is where the chunk starts in it).

A connection must present the cluster token in its first frame (compared in
constant time) within `handshake_s`; anything else is refused and closed and
the seed keeps serving. A JOIN of another wire version (none: version 1) is
refused with a JOIN_NACK naming the side to upgrade (wire.py), and logged.
Every socket has a deadline (`idle_s` of silence), and at most `max_clients`
transfers run at once (JOIN_NACK "busy" beyond; past `max_clients +
MAX_HANDSHAKES` open connections, new ones are closed at once).
"""

from __future__ import annotations

import hmac
import socket
import threading
import time

import msgspec
import structlog

from ascendserve.netloader import wire
from ascendserve.netloader.checkpoint import CheckpointError, CheckpointIndex, MappedSource, MemorySource
from ascendserve.protocol.frames import FrameError, encode, read_frame, send_blocks, send_frame

log = structlog.get_logger("ascendserve.netloader.seed")
MAX_JOIN_BYTES = 0  # JOIN/GET carry no payload
MAX_HANDSHAKES = 64  # connections beyond the transfers (handshaking, or told "busy") before refusing outright


class Seed:
    def __init__(self, source: MappedSource | MemorySource, token: str, host: str, port: int,
                 max_clients: int = 16, handshake_s: float = 10.0, idle_s: float = 60.0):
        self.source = source
        self.index: CheckpointIndex = source.index
        self._manifest = msgspec.msgpack.encode(self.index.manifest())  # every JOIN_ACK's payload
        if len(self._manifest) > wire.MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{self.index.model_dir}: the manifest of {len(self.index.entries)} tensors "
                                  f"takes {len(self._manifest)} bytes, over the wire's {wire.MAX_MANIFEST_BYTES}")
        self.token = token.encode()
        self.max_clients = max_clients
        self.handshake_s, self.idle_s = handshake_s, idle_s
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._running = 0  # connections transferring (a joiner's further streams each count)
        self._running_lock = threading.Lock()  # also guards the counters and the two sets below
        self._open: set[socket.socket] = set()  # connections being served, shut down by stop()
        self._workers: set[threading.Thread] = set()  # their threads, waited for by stop()
        self._connections = threading.BoundedSemaphore(max_clients + MAX_HANDSHAKES)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="netloader-seed", daemon=True)
        self.served = 0
        self.refused = 0

    def start(self) -> "Seed":
        self._thread.start()
        log.info("netloader seed serving", port=self.port, tensors=len(self.index.entries),
                 gib=round(self.index.total_bytes / 2**30, 3), source=type(self.source).__name__)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (transfers part way get an error), wait up to
        `timeout_s` for their threads, then release the weights."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._running_lock:  # no connection registers after this (_serve checks _stop under the lock)
            conns, workers = list(self._open), list(self._workers)
        for conn in conns:  # wakes a thread blocked in recv, send or sendfile
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        left = sum(w.is_alive() for w in workers)
        if left:
            log.warning("netloader seed: connection threads still running at stop", threads=left)
        self.source.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set():  # stop() closed the listener
                    return
                # out of descriptors (EMFILE), a connection aborted before accept...: not the end of serving
                log.warning("netloader seed: accept failed; retrying", error=f"{type(exc).__name__}: {exc}")
                self._stop.wait(0.1)
                continue
            if not self._connections.acquire(blocking=False):  # a flood of idle sockets costs no threads
                self._count("refused")
                log.warning("netloader: too many connections; refusing", peer=peer[0])
                conn.close()
                continue
            worker = threading.Thread(target=self._serve_counted, args=(conn, peer), name="netloader-send",
                                      daemon=True)
            with self._running_lock:
                self._workers.add(worker)
            try:
                worker.start()
            except RuntimeError as exc:  # no thread to be had: this connection only
                log.warning("netloader: cannot start a connection thread; refusing", error=str(exc))
                with self._running_lock:
                    self._workers.discard(worker)
                self._connections.release()
                conn.close()

    def _serve_counted(self, conn: socket.socket, peer) -> None:
        try:
            self._serve(conn, peer)
        finally:
            self._connections.release()
            with self._running_lock:
                self._workers.discard(threading.current_thread())

    def _count(self, counter: str) -> None:
        with self._running_lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _serve(self, conn: socket.socket, peer) -> None:
        with self._running_lock:
            if self._stop.is_set():
                conn.close()
                return
            self._open.add(conn)
        with conn:
            try:
                conn.settimeout(self.handshake_s)
                join = read_frame(conn, MAX_JOIN_BYTES)
                reason = self._check_join(join)
                if reason == "token":
                    self._count("refused")
                    log.warning("netloader: refused a connection without a valid cluster token", peer=peer[0])
                    send_frame(conn, {"type": "JOIN_NACK", "reason": "cluster token missing or wrong"})
                    return
                if reason:
                    log.warning("netloader: refused a joiner", peer=peer[0], reason=reason)
                    send_frame(conn, {"type": "JOIN_NACK", "reason": reason})
                    return
                if not self._take_slot(join.get("stream", 0)):
                    send_frame(conn, {"type": "JOIN_NACK", "reason": f"busy: {self.max_clients} transfers running"})
                    return
                try:
                    self._transfer(conn, join, peer)
                finally:
                    with self._running_lock:
                        self._running -= 1
            except (FrameError, ConnectionError, TimeoutError, OSError) as exc:
                log.warning("netloader: connection dropped", peer=peer[0], error=f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # e.g. stop() closed the source under a running transfer: this connection only
                log.warning("netloader: transfer failed", peer=peer[0], error=f"{type(exc).__name__}: {exc}")
            finally:
                with self._running_lock:
                    self._open.discard(conn)

    def _take_slot(self, stream) -> bool:
        """A joiner's first stream may take any free slot; its further streams (`stream` > 0) leave a
        quarter of them free, so that other joiners' first streams still find one."""
        limit = self.max_clients if stream == 0 else self.max_clients - self.max_clients // 4
        with self._running_lock:
            if self._running >= limit:
                return False
            self._running += 1
            return True

    def _check_join(self, join: dict) -> str | None:
        token = join.get("token")
        if join.get("type") != "JOIN" or not isinstance(token, str) or \
                not hmac.compare_digest(token.encode(), self.token):
            return "token"
        stream = join.get("stream", 0)
        if type(stream) is not int or not 0 <= stream < wire.MAX_STREAMS:
            return f"JOIN's stream must be an integer in [0, {wire.MAX_STREAMS}), got {str(stream)[:40]!r}"
        return wire.join_refusal(join)

    def _transfer(self, conn: socket.socket, join: dict, peer) -> None:
        conn.sendall(encode({"type": "JOIN_ACK", "version": wire.WIRE_VERSION, "identity": self.index.identity,
                             "total_bytes": self.index.total_bytes}, len(self._manifest)))
        send_blocks(conn, self._manifest)
        conn.settimeout(self.idle_s)
        get = read_frame(conn, MAX_JOIN_BYTES)
        if get["type"] != "GET":
            raise FrameError(f"expected GET, got {get['type']}")
        part, parts = get.get("part", 0), get.get("parts", 1)
        if type(parts) is not int or not 1 <= parts <= wire.MAX_STREAMS or type(part) is not int \
                or not 0 <= part < parts:
            raise FrameError(f"GET of part {str(part)[:20]} of {str(parts)[:20]}")
        if part == 0:  # one per joiner's transfer
            log.info("netloader: sending weights", peer=peer[0], tp_rank=join.get("tp_rank"), streams=parts,
                     gib=round(self.index.total_bytes / 2**30, 3))
        entries = self.index.entries
        for i, offset, count in wire.plan([e.nbytes for e in entries], parts)[part]:
            entry = entries[i]
            conn.sendall(encode({"type": "TENSOR", "index": i, "name": entry.name, "offset": offset}, count))
            if offset == 0 and count == entry.nbytes:
                self.source.send(conn, entry)
            else:
                self.source.send(conn, entry, offset, count)
        send_frame(conn, {"type": "DONE"})
        if part == 0:
            self._count("served")
