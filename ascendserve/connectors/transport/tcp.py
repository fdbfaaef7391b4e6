"""Plain TCP transport: one frame per request for the whole transfer, no per-block round trip.

    consumer -> HELLO {token, layout}          producer -> OK | ERR {reason}, close
    consumer -> READ {request_id, blocks}      producer -> DATA {payload: n} + n bytes | ERR
    consumer -> FREE {request_id}              producer -> OK
A HELLO without a layout opens a control session that may only FREE.
Every connection must start with a valid HELLO carrying the cluster token
(compared in constant time) and the same KV layout; anything else is
logged and the connection closed. The server keeps serving.
"""

from __future__ import annotations

import hmac
import socket
import threading

import structlog

from ascendserve.connectors.transport.base import PageSource, TransferError, TransportClient, TransportServer
from ascendserve.connectors.transport.threads import unpin_current_thread
from ascendserve.protocol.frames import FrameError, read_frame, recv_exact, send_frame

log = structlog.get_logger("ascendserve.kv.tcp")
CONTROL_PAYLOAD_MAX = 0  # requests from consumers carry no payload
SOCKET_BUFFER = 4 * 1024 * 1024


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


class TcpServer(TransportServer):
    def __init__(self, host: str, port: int, source: PageSource, token: str, max_connections: int = 256,
                 idle_timeout_s: float = 300.0):
        self.host, self.port, self.source, self.token = host, port, source, token
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.rejected = 0

    def start(self) -> None:
        sock = socket.create_server((self.host, self.port), reuse_port=False, backlog=128)
        sock.settimeout(0.5)
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()
        log.info("KV side channel listening", host=self.host, port=self.port)

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
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-tcp-conn", daemon=True).start()

    def _reject(self, conn: socket.socket, peer, reason: str) -> None:
        self.rejected += 1
        log.warning("KV side channel rejected a connection", peer=peer[0], reason=reason)
        try:
            send_frame(conn, {"type": "ERR", "reason": reason})
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer) -> None:
        unpin_current_thread()
        try:
            _tune(conn)
            conn.settimeout(self.idle_timeout_s)
            hello = read_frame(conn, CONTROL_PAYLOAD_MAX)
            if hello["type"] != "HELLO" or not isinstance(hello.get("token"), str):
                return self._reject(conn, peer, "expected HELLO with a token")
            if not hmac.compare_digest(hello["token"].encode(), self.token.encode()):
                return self._reject(conn, peer, "invalid cluster token")
            # A HELLO without a layout opens a control session: FREE only (e.g. a
            # proxy releasing the KV of a request whose client went away).
            can_read = "layout" in hello
            problem = self.source.check_hello(hello) if can_read else None
            if problem:
                return self._reject(conn, peer, problem)
            send_frame(conn, {"type": "OK"})
            while not self._stop.is_set():
                msg = read_frame(conn, CONTROL_PAYLOAD_MAX)
                kind, request_id = msg["type"], msg.get("request_id")
                if not isinstance(request_id, str):
                    return self._reject(conn, peer, f"{kind} without a request_id")
                if kind == "READ" and not can_read:
                    return self._reject(conn, peer, "READ on a control session (HELLO without a layout)")
                if kind == "READ":
                    blocks = msg.get("blocks")
                    if not isinstance(blocks, list) or not all(isinstance(b, int) for b in blocks):
                        return self._reject(conn, peer, "READ blocks must be a list of integers")
                    try:
                        data = self.source.read(request_id, blocks)
                    except (KeyError, ValueError) as exc:
                        send_frame(conn, {"type": "ERR", "reason": str(exc)})
                        continue
                    send_frame(conn, {"type": "DATA"}, data)
                elif kind == "FREE":
                    self.source.free(request_id)
                    send_frame(conn, {"type": "OK"})
                else:
                    return self._reject(conn, peer, f"unknown message type {kind!r}")
        except FrameError as exc:
            self._reject(conn, peer, f"bad frame: {exc}")
        except (ConnectionError, TimeoutError, socket.timeout, OSError):
            pass
        finally:
            conn.close()
            self._slots.release()


class TcpClient(TransportClient):
    """One cached connection per producer; each is used by one transfer at a time."""

    def __init__(self, token: str, layout: dict | None, connect_timeout_s: float = 5.0, io_timeout_s: float = 60.0):
        self.token, self.layout = token, layout
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()

    def _connect(self, host: str, port: int) -> socket.socket:
        with self._lock:
            pool = self._idle.get((host, port))
            if pool:
                return pool.pop()
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            _tune(sock)
            sock.settimeout(self.io_timeout_s)
            hello = {"type": "HELLO", "token": self.token}
            if self.layout is not None:
                hello["layout"] = self.layout
            send_frame(sock, hello)
            answer = read_frame(sock, 0)
        except (OSError, FrameError) as exc:
            raise TransferError(f"KV side channel {host}:{port} unreachable: {exc}") from None
        if answer["type"] != "OK":
            sock.close()
            raise TransferError(f"KV side channel {host}:{port} refused: {answer.get('reason')}")
        return sock

    def _release(self, host: str, port: int, sock: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault((host, port), []).append(sock)

    def read(self, host: str, port: int, request_id: str, block_ids: list[int], into: memoryview) -> None:
        sock = self._connect(host, port)
        try:
            send_frame(sock, {"type": "READ", "request_id": request_id, "blocks": block_ids})
            answer = read_frame(sock, len(into))
            if answer["type"] != "DATA":
                raise TransferError(f"producer refused READ {request_id}: {answer.get('reason')}")
            if answer.get("payload", 0) != len(into):
                raise TransferError(f"producer sent {answer.get('payload')} bytes, expected {len(into)}")
            recv_exact(sock, len(into), into)
        except (OSError, FrameError) as exc:
            sock.close()
            raise TransferError(f"KV read of {request_id} from {host}:{port} failed: {exc}") from None
        except TransferError:
            self._release(host, port, sock)
            raise
        self._release(host, port, sock)

    def free(self, host: str, port: int, request_id: str) -> bool:
        try:
            sock = self._connect(host, port)
        except TransferError:
            return False  # the producer's deadline frees the blocks
        try:
            send_frame(sock, {"type": "FREE", "request_id": request_id})
            ok = read_frame(sock, 0)["type"] == "OK"
            self._release(host, port, sock)
            return ok
        except (OSError, FrameError):
            sock.close()
            return False

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for sock in pool:
                    sock.close()
            self._idle.clear()


def free_remote(token: str, host: str, port: int, request_id: str, ranks: int = 1, timeout_s: float = 2.0) -> int:
    """Release a held request on every TP rank of a producer (ports port..port+ranks-1)
    over control sessions. Best effort and bounded; returns how many ranks answered."""
    client = TcpClient(token, None, connect_timeout_s=timeout_s, io_timeout_s=timeout_s)
    answered = 0
    try:
        for rank in range(ranks):
            answered += client.free(host, port + rank, request_id)
    finally:
        client.close()
    if answered < ranks:
        log.debug("KV free not acknowledged by every rank", peer=f"{host}:{port}", request=request_id,
                  answered=answered, ranks=ranks)
    return answered
