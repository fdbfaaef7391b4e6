"""The KV side channel: one TCP control protocol for every transport.

    D -> HELLO {token, transport, layout}   P -> OK {transport's offer} | ERR {reason}, close
    D -> READ {request_id, blocks}          P -> the transport's answer (DATA, SHM, GRANT) | ERR
    D -> FREE {request_id}                  P -> OK
    P's scheduler -> HOLD {request_id, blocks, ttl_s, at}   (no answer; from this host only)
Push mode runs the other way on the same protocol (P connects to D):
    P -> PUSH {request_id, layer, blocks} + one layer's pages     (no answer)
    P -> PUSHED {request_id, ok}            D -> OK
A HELLO without a layout opens a control session that may only FREE (the
proxy uses it to release a hold whose client went away) or HOLD (P's
scheduler announcing a hold the moment its request finished, before the
engine's next step tells the worker; kv/hold_announcer.py). The cluster token
is compared in constant time; every refusal is logged and the connection
closed, and the server keeps serving. Frames are msgpack (protocol/frames.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
import time

import structlog

from ascendserve.connectors.kv.page_geometry import layout_mismatch
from ascendserve.connectors.transport.base import Holds, Pages, PushSink, TransferError, Transport
from ascendserve.connectors.transport.threads import unpin_current_thread
from ascendserve.connectors.transport.tcp import recv_layer, recv_views
from ascendserve.protocol.frames import FrameError, encode, read_frame, send_frame

log = structlog.get_logger("ascendserve.kv.channel")
SOCKET_BUFFER = 4 * 1024 * 1024
HANDSHAKE_S = 10.0  # a connection must send its HELLO within this


def _drain(conn: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        got = conn.recv_into(scratch, min(n, len(scratch)))
        if got == 0:
            raise ConnectionError("peer closed the connection")
        n -= got


def _same_host(conn: socket.socket, peer) -> bool:
    """Whether the peer of `conn` is this host: loopback, or our own address."""
    try:
        return ipaddress.ip_address(peer[0]).is_loopback or peer[0] == conn.getsockname()[0]
    except (ValueError, OSError):
        return False


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


class ChannelServer:
    def __init__(self, host: str, port: int, holds: Holds, pages: Pages, token: str,
                 transports: dict[str, Transport], max_connections: int = 256, idle_timeout_s: float = 300.0,
                 sink: PushSink | None = None, max_push_blocks: int = 0):
        self.host, self.port, self.holds, self.pages, self.token = host, port, holds, pages, token
        self.transports, self.sink = transports, sink
        self.max_push_payload = max_push_blocks * pages.page_bytes if sink is not None else 0
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.rejected = 0

    def start(self) -> None:
        sock = socket.create_server((self.host, self.port), backlog=128)
        sock.settimeout(0.5)
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="kv-channel-accept", daemon=True).start()
        log.info("KV side channel listening", host=self.host, port=self.port, transports=sorted(self.transports))

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()

    def _accept_loop(self) -> None:
        unpin_current_thread()
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("too many KV connections; refusing", peer=peer[0])
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-channel-conn", daemon=True).start()

    def _take_push(self, conn: socket.socket, kind: str, request_id: str, msg: dict,
                   transport: Transport) -> str | None:
        """D: one pushed layer. Its pages come as the frame's payload (tcp), through the
        producer's shared-memory segment (shm: answer ACK once copied out), or were
        already written into the reserved blocks by the producer (mooncake: `written`)."""
        if kind == "PUSHED":
            self.sink.complete(request_id, msg.get("ok") is True)
            send_frame(conn, {"type": "OK"})
            return None
        layer, blocks = msg.get("layer"), msg.get("blocks")
        if type(layer) is not int or not 0 <= layer < self.pages.num_layers:
            return f"PUSH layer must be an integer in [0, {self.pages.num_layers})"
        if not isinstance(blocks, list) or len(blocks) > self.pages.num_blocks \
                or not all(type(b) is int for b in blocks):
            return f"PUSH blocks must be a list of at most {self.pages.num_blocks} integers"
        size = len(blocks) * self.pages.page_bytes
        via_shm = msg.get("shm") is not None
        if via_shm:
            if transport.name != "shm" or not isinstance(msg["shm"], str) or msg.get("payload", 0):
                return "PUSH through shared memory needs the shm transport and no payload"
            data = transport.view(conn, msg["shm"], size).reshape(len(blocks), self.pages.page_bytes)
        elif msg.get("written") is True:
            if transport.name != "mooncake" or msg.get("payload", 0):
                return "a PUSH already written needs the mooncake transport and no payload"
            data = None
        else:
            if msg.get("payload", 0) != size:
                return f"PUSH of {len(blocks)} pages must carry {size} bytes"
            data = None
            try:  # checked first, then received straight into the reserved pages
                self.sink.check(request_id, blocks)
                if self.pages.host_visible:
                    recv_layer(conn, self.pages, layer, blocks)
                else:  # device pages: through a host buffer, scattered by the sink
                    import numpy as np  # not at the top: the proxy imports this module

                    data = np.empty((len(blocks), self.pages.page_bytes), dtype=np.uint8)
                    recv_views(conn, [memoryview(data).cast("B")])
            except (KeyError, ValueError) as exc:
                log.warning("pushed KV refused", request=request_id, reason=str(exc).strip("'\""))
                _drain(conn, size)
                return None
        try:
            self.sink.receive(request_id, layer, blocks, data)
        except (KeyError, ValueError, TransferError) as exc:  # one-way: the sink records the failure
            log.warning("pushed KV refused", request=request_id, reason=str(exc).strip("'\""))
        finally:
            del data
            if via_shm:
                send_frame(conn, {"type": "ACK"})
        return None

    def _take_hold(self, conn: socket.socket, peer, request_id: str, msg: dict) -> str | None:
        """P's scheduler announces a hold (one-way): only from this host, well-formed."""
        if not _same_host(conn, peer):
            return "HOLD is taken from this host only"
        blocks, ttl_s, at = msg.get("blocks"), msg.get("ttl_s"), msg.get("at")
        if not isinstance(blocks, list) or len(blocks) > self.pages.num_blocks \
                or not all(type(b) is int and 0 <= b < self.pages.num_blocks for b in blocks):
            return f"HOLD blocks must be a list of at most {self.pages.num_blocks} block ids"
        if not all(type(v) in (int, float) and 0 <= v < 1e12 for v in (ttl_s, at)):
            return "HOLD needs ttl_s and at (seconds) as non-negative numbers"
        self.holds.announce(request_id, blocks, float(ttl_s), time.time() - float(at))
        return None

    def _reject(self, conn: socket.socket, peer, reason: str) -> None:
        self.rejected += 1
        log.warning("KV side channel rejected a connection", peer=peer[0], reason=reason)
        try:
            send_frame(conn, {"type": "ERR", "reason": reason})
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer) -> None:
        unpin_current_thread()
        transport: Transport | None = None
        pushing: set[str] = set()  # requests with layers pushed on this connection, not yet complete
        try:
            _tune(conn)
            conn.settimeout(min(self.idle_timeout_s, HANDSHAKE_S))  # a silent peer must not hold a slot long
            hello = read_frame(conn, 0)
            if hello["type"] != "HELLO" or not isinstance(hello.get("token"), str):
                return self._reject(conn, peer, "expected HELLO with a token")
            if not hmac.compare_digest(hello["token"].encode(), self.token.encode()):
                return self._reject(conn, peer, "invalid cluster token")
            can_read = "layout" in hello
            if can_read:
                mine = self.pages.layout()
                problem = layout_mismatch(hello["layout"], mine)
                if problem:
                    return self._reject(conn, peer, problem)
                name = hello.get("transport", "tcp")
                transport = self.transports.get(name) if isinstance(name, str) else None
                if transport is None:
                    return self._reject(conn, peer, f"transport {hello.get('transport')!r} not offered here "
                                                    f"(offered: {', '.join(sorted(self.transports))})")
            send_frame(conn, {"type": "OK", **(transport.offer() if transport else {})})
            conn.settimeout(self.idle_timeout_s)
            while not self._stop.is_set():
                msg = read_frame(conn, self.max_push_payload if transport is not None else 0)
                kind, request_id = msg["type"], msg.get("request_id")
                if not isinstance(request_id, str):
                    return self._reject(conn, peer, f"{kind} without a request_id")
                if msg.get("payload", 0) and kind != "PUSH":
                    return self._reject(conn, peer, f"{kind} must not carry a payload")
                if kind in ("PUSH", "PUSHED"):
                    if self.sink is None or transport is None:
                        return self._reject(conn, peer, f"{kind}: this instance takes no pushed KV")
                    problem = self._take_push(conn, kind, request_id, msg, transport)
                    if problem:
                        return self._reject(conn, peer, problem)
                    (pushing.add if kind == "PUSH" else pushing.discard)(request_id)
                elif kind == "READ":
                    if transport is None:
                        return self._reject(conn, peer, "READ on a control session (HELLO without a layout)")
                    blocks, heads = msg.get("blocks"), msg.get("heads")
                    if not isinstance(blocks, list) or len(blocks) > self.pages.num_blocks \
                            or not all(type(b) is int for b in blocks):  # repeats could ask for any size
                        return self._reject(conn, peer, f"READ blocks must be a list of at most "
                                                        f"{self.pages.num_blocks} integers")
                    if heads is not None and not (isinstance(heads, list) and len(heads) == 2
                                                  and all(type(h) is int for h in heads)
                                                  and 0 <= heads[0] and 1 <= heads[1]
                                                  and heads[0] + heads[1] <= self.pages.num_heads):
                        return self._reject(conn, peer, f"READ heads must be [first, count] within "
                                                        f"{self.pages.num_heads} heads")
                    try:
                        self.holds.acquire(request_id, blocks)
                    except (KeyError, ValueError) as exc:
                        send_frame(conn, {"type": "ERR", "reason": str(exc).strip("'\"")})
                        continue
                    try:
                        transport.serve_read(conn, self.pages, blocks, tuple(heads) if heads else None)
                    finally:
                        self.holds.release(request_id)
                elif kind == "FREE":
                    self.holds.free(request_id)
                    send_frame(conn, {"type": "OK"})
                elif kind == "HOLD":
                    problem = self._take_hold(conn, peer, request_id, msg)
                    if problem:
                        return self._reject(conn, peer, problem)
                else:
                    return self._reject(conn, peer, f"unknown message type {kind!r}")
        except FrameError as exc:
            self._reject(conn, peer, f"bad frame: {exc}")
        except (ConnectionError, TimeoutError, socket.timeout, OSError, TransferError):
            pass
        finally:
            conn.close()
            for request_id in pushing:  # the producer went away mid-push: fail now, not at the deadline
                self.sink.complete(request_id, False)
            release = getattr(transport, "release_thread_segment", None)
            if release is not None:
                release()
            self._slots.release()


class ChannelClient:
    """D's side: pulls pages with one transport; one cached connection per producer per
    transfer thread (a connection carries one transfer at a time)."""

    def __init__(self, token: str, pages: Pages | None, transport: Transport | None,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 60.0):
        self.token, self.pages, self.transport = token, pages, transport
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, dict]]] = {}
        self._lock = threading.Lock()

    def _connect(self, host: str, port: int, control: bool = False) -> tuple[socket.socket, dict]:
        if not control:
            with self._lock:
                pool = self._idle.get((host, port))
                if pool:
                    return pool.pop()
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            _tune(sock)
            sock.settimeout(self.io_timeout_s)
            hello = {"type": "HELLO", "token": self.token}
            if not control:
                hello.update(layout=self.pages.layout(), transport=self.transport.name)
            send_frame(sock, hello)
            answer = read_frame(sock, 0)
        except (OSError, FrameError) as exc:
            raise TransferError(f"KV side channel {host}:{port} unreachable: {exc}") from None
        if answer["type"] != "OK":
            sock.close()
            raise TransferError(f"KV side channel {host}:{port} refused: {answer.get('reason')}")
        return sock, answer

    def _release(self, host: str, port: int, conn: tuple[socket.socket, dict]) -> None:
        with self._lock:
            self._idle.setdefault((host, port), []).append(conn)

    def pull(self, host: str, port: int, request_id: str, remote_blocks: list[int],
             local_blocks: list[int], heads: tuple[int, int, int] | None = None) -> int:
        """Land the pages of `remote_blocks` of a held request in `local_blocks`; bytes moved.
        `heads` = (first on P, first here, count) moves one run of KV heads of each page."""
        if len(remote_blocks) != len(local_blocks):
            raise TransferError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote")
        sock, offer = self._connect(host, port)
        read = {"type": "READ", "request_id": request_id, "blocks": remote_blocks}
        if heads is not None:
            read["heads"] = [heads[0], heads[2]]
        try:  # encoded in here: a READ over the header limit is a FrameError like any other
            moved = self.transport.fetch(sock, offer, self.pages, remote_blocks, local_blocks, heads, encode(read))
        except (OSError, FrameError, TransferError) as exc:
            sock.close()  # its state is unknown after a failure
            raise TransferError(f"KV read of {request_id} from {host}:{port} failed: {exc}") from None
        except BaseException:  # e.g. ValueError: local blocks out of range; never back to the pool
            sock.close()
            raise
        self._release(host, port, (sock, offer))
        return moved

    def free(self, host: str, port: int, request_id: str) -> bool:
        """Best effort: tell the producer to release `request_id` now; True if it answered."""
        try:
            sock, offer = self._connect(host, port, control=self.transport is None)
        except TransferError:
            return False  # the producer's deadline frees the blocks
        try:
            send_frame(sock, {"type": "FREE", "request_id": request_id})
            ok = read_frame(sock, 0)["type"] == "OK"
        except (OSError, FrameError):
            sock.close()
            return False
        if self.transport is None:
            sock.close()
        else:
            self._release(host, port, (sock, offer))
        return ok

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for sock, _ in pool:
                    sock.close()
            self._idle.clear()


def free_remote(token: str, host: str, port: int, request_id: str, ranks: int = 1, timeout_s: float = 2.0) -> int:
    """Release a held request on every TP rank of a producer (ports port..port+ranks-1)
    over control sessions. Best effort and bounded; returns how many ranks answered."""
    client = ChannelClient(token, None, None, connect_timeout_s=timeout_s, io_timeout_s=timeout_s)
    answered = sum(client.free(host, port + rank, request_id) for rank in range(ranks))
    if answered < ranks:
        log.debug("KV free not acknowledged by every rank", peer=f"{host}:{port}", request=request_id,
                  answered=answered, ranks=ranks)
    return answered
