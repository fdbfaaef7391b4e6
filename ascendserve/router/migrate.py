"""A generation that survives its instance: relay through the token ledger, continue elsewhere.

`Generation.run()` yields the client's SSE bytes (or, for a non-streaming request, nothing: the
body is `ledger.response()` once it ends). Each leg is one engine stream, read event by event with
a stall deadline (`stall_timeout_s` without an event: the instance has failed for this request and
is health-checked at once). A leg that breaks before the request finished (connection reset, an
error event, the stream ending early, a stall) is continued on another healthy instance of the
role: the ledger's token-id continuation, spliced onto what the client already has. At most
`migration_limit` times; never once the client is gone (the generator is closed then).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import msgspec
import structlog

from ascendserve.protocol.openai import APIError
from ascendserve.router import tracing
from ascendserve.router.ledger import BackendFailed, Ledger
from ascendserve.router.pools import EJECTED, Instance, Lease
from ascendserve.router.sse import DONE, encode, payloads, sse_error

log = structlog.get_logger("ascendserve.router")
EJECTION_CHECK_S = 1.0  # how often a silent stream looks whether its instance was ejected
END_WAIT_S = 1.0  # the longest wait after [DONE] for the engine's end of response (Leg.end)


def _anywhere() -> bool:
    return True


class Leg:
    """One engine stream of a generation: its lease, response and whole-event framing, and the
    watchdog that gives it up when the engine goes silent (`next_whole`)."""

    def __init__(self, lease: Lease, response, framer):
        self.lease, self.response, self.framer = lease, response, framer
        self.stall_s, self.elsewhere = 0.0, _anywhere  # the current wait's deadline and its question
        self.since = 0.0  # when the engine last said something, or the current wait began
        self._watch: asyncio.TimerHandle | None = None

    @property
    def instance(self) -> Instance:
        return self.lease.instance

    async def next_events(self, stall_s: float, elsewhere: Callable[[], bool] = _anywhere
                          ) -> tuple[list[bytes], bool, bool]:
        """The next whole events' payloads (parse() decodes one), whether [DONE] came, whether the
        stream ended (next_whole, and events_of)."""
        return self.events_of(await self.next_whole(stall_s, elsewhere))

    async def next_whole(self, stall_s: float, elsewhere: Callable[[], bool] = _anywhere) -> bytes | None:
        """The next whole events as the engine sent them, None once the stream ended. Raises
        BackendFailed on a stall (no byte for `stall_s`), on the instance's ejection by its health
        checks while it says nothing (a frozen instance may hold a request before its first token
        longer than any stall deadline) or a broken connection.

        The reads are not timed one by one (a timer each was a sixth of the ledger's cost a read):
        one watchdog a leg (`_check`) looks in at most every EJECTION_CHECK_S and interrupts the
        read it finds waiting past either deadline."""
        self.stall_s, self.elsewhere = stall_s, elsewhere
        self.since = time.monotonic()
        if self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(min(EJECTION_CHECK_S, stall_s), self._check)
        while True:
            try:
                chunk = await self.response.readany()
            except (aiohttp.ClientError, ConnectionError, OSError) as exc:
                raise BackendFailed("connection", repr(exc)) from None
            if not chunk:
                return None
            whole = self.framer.feed(chunk)
            if whole:
                return whole
            self.since = time.monotonic()  # part of an event: the engine is not silent

    def events_of(self, whole: bytes | None) -> tuple[list[bytes], bool, bool]:
        """next_whole's answer as payloads, whether [DONE] came, whether the stream ended (then
        what it sent after its last whole event is taken too)."""
        if whole is not None:
            evs, done = payloads(whole)
            return evs, done, False
        rest = self.framer.flush()
        evs, done = payloads(rest) if rest else ([], False)
        return evs, done, True

    def _check(self) -> None:
        """The watchdog: a read waiting past the stall deadline (with another instance to go to), or
        for EJECTION_CHECK_S on an instance its health checks ejected, is interrupted
        (BackendFailed); otherwise it looks again at the next deadline, or in EJECTION_CHECK_S."""
        self._watch = None
        response = self.response
        if response.ended:  # read to its end, failed or closed: nothing to watch
            return
        now = time.monotonic()
        if response.waiting:
            silent = now - self.since
            if silent >= EJECTION_CHECK_S and self.instance.state == EJECTED:
                return response.interrupt(BackendFailed("ejected", "its health checks failed while it was silent"))
            if silent >= self.stall_s:
                if self.elsewhere():
                    return response.interrupt(BackendFailed("stall", f"no event for {self.stall_s:g} s"))
                self.since, silent = now, 0.0  # a slow instance, and no other: keep waiting
            # the next look: at the stall deadline, or when it has been silent EJECTION_CHECK_S (again)
            wait = min(self.stall_s, EJECTION_CHECK_S * (1 + int(silent / EJECTION_CHECK_S))) - silent
        else:  # the client is being written to: not the engine's silence
            wait = min(self.stall_s, EJECTION_CHECK_S)
        self._watch = asyncio.get_running_loop().call_later(max(wait, 0.001), self._check)

    def _unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def end(self) -> None:
        """After [DONE]: the rest of the engine's response read and dropped (most often its end of
        body, in flight), so that its connection goes back to the pool instead of being closed. At
        most END_WAIT_S; the client's stream has ended already (router/hot_path.py)."""
        self._unwatch()
        try:
            while await self.response.readany(END_WAIT_S):
                pass
        except (TimeoutError, aiohttp.ClientError, ConnectionError, OSError):
            pass  # closed by close(): the engine is not told anything it needs

    def close(self, ok: bool) -> None:
        self._unwatch()
        self.response.close()  # on a live instance this aborts the request there
        self.lease.release(ok=ok)


OpenLeg = Callable[[str, dict, frozenset[str]], Awaitable[tuple[Leg, list[dict], bool]]]  # role, body, instances it may not use


class Generation:
    def __init__(self, ledger: Ledger, role: str, first: Leg, first_events: list[dict], first_done: bool,
                 open_leg: OpenLeg, pick: Callable[[str, frozenset[str]], Instance | None],
                 detokenize: Callable[[Instance | None, list[int]], Awaitable[str | None]],
                 settings, metrics, on_stall: Callable[[Instance], None],
                 on_broken: Callable[[Instance], None], request_id: str):
        self.ledger, self.role, self.leg = ledger, role, first
        self.pending, self.pending_done = first_events, first_done
        self.open_leg, self.pick, self.detokenize = open_leg, pick, detokenize
        self.settings, self.metrics = settings, metrics
        self.on_stall, self.on_broken = on_stall, on_broken
        self.request_id = request_id
        self.failed_at: float | None = None
        self.base = ""  # the original prompt's text (/detokenize), for the text across a cut
        self.fixing = False  # the cut fell inside a character: the next text comes from /detokenize
        self.cut_text = ""  # the generated tokens' text at the cut, up to its last whole character
        self.error = ""  # why the generation could not be completed ("" when it was)
        self.answered_at: float | None = None  # when the client's stream was whole (its [DONE] sent)
        self.first_at: float | None = None  # when its first bytes went to the client

    async def run(self, report: Callable[[BaseException | None], None] | None = None) -> AsyncIterator[bytes]:
        """The client's bytes, leg after leg; `report(failure)` once it is over (None: it ran to its
        end; else the exception that ended it, a client's disconnect included), in this generator
        itself: a wrapping one would cost every chunk another step."""
        led = self.ledger
        ok = False
        failure: BaseException | None = None
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._leg()) as leg_events:
                        async for out in leg_events:
                            if self.first_at is None:
                                self.first_at = time.monotonic()
                            yield out
                    self.answered_at = time.monotonic()
                    if led.stream:  # (a whole answer is not held back for it)
                        await self.leg.end()
                    ok = True
                    if led.fingerprint is not None:  # for a later answer whose usage event never comes
                        self.leg.instance.remember_fingerprint(led.fingerprint)
                    return
                except BackendFailed as failure:
                    inst = self.leg.instance
                    self.leg.close(ok=False)
                    tracing.leg_failed(failure.reason, failure.detail)
                    self.failed_at = time.monotonic()
                    if failure.reason == "stall":
                        self.on_stall(inst)
                    elif failure.reason not in ("ejected", "diverged"):  # most often a dead instance:
                        # its health check says at once
                        self.on_broken(inst)
                    if led.finished:  # it died after its last token: nothing is missing but the usage
                        for out in self._close_finished():
                            yield out
                        ok = True
                        return
                    why_not = led.not_migratable or ("its replay generated other tokens" if failure.reason == "diverged"
                                                     else None) or (
                        "migration limit reached" if led.migrations >= self.settings.migration_limit else None)
                    message = (f"backend {self.role} instance failed mid-stream ({failure.reason}: "
                               f"{failure.detail[:120]}); not continued: {why_not}") if why_not else ""
                    if not message:
                        try:
                            await self._migrate(inst, failure.reason)
                        except APIError as exc:
                            message = (f"backend {self.role} instance failed mid-stream ({failure.reason}) and "
                                       f"no other could continue: {exc.message[:200]}")
                    if message:
                        self._fail(message)
                        if led.stream:
                            yield sse_error(self.error)
                        return
        except BaseException as exc:  # GeneratorExit and CancelledError: the client went
            failure = exc
            raise
        finally:
            if self.leg is not None:
                self.leg.close(ok=ok)
            if report is not None:
                report(failure)

    def _elsewhere(self) -> bool:
        """Is there another live instance to continue on, should this one go silent?"""
        return self.pick(self.role, frozenset({self.leg.instance.url})) not in (None, self.leg.instance)

    def _fail(self, message: str) -> None:
        self.error = message
        tracing.failed(message)
        self.metrics.errors.labels("mid_stream").inc()
        log.warning("backend failed mid-stream", request_id=self.request_id, url=self.leg.instance.url,
                    detail=message[:300], tokens=len(self.ledger.generated))

    async def _leg(self) -> AsyncIterator[bytes]:
        """The current leg's events to the client, one write per read from the engine."""
        led = self.ledger
        evs, done, ended = self.pending, self.pending_done, False
        self.pending = []
        while True:
            if self.fixing and led.on_continuation:
                evs = [ev if ev.__class__ is dict else parse(ev) for ev in evs]
                before: list[int] = []  # ids of this read's events before the one being fixed
                for ev in evs:
                    await self._fix_text(ev, before)
                    before += ((ev.get("choices") or [{}])[0].get("token_ids") or []) if ev.get("choices") else []
            out: list[bytes] = []
            try:
                if self._events(evs, out):  # a stop string across the cut ended the answer
                    self.leg.close(ok=True)
                    out += self._close_finished()
                    return
                if done:
                    if not led.finished:
                        raise BackendFailed("ended", "[DONE] before a finish_reason")
                    if led.stream:
                        out += [encode(e) for e in led.flush_final()]
                        out.append(DONE)
                    return
                if ended:
                    if not led.finished:
                        raise BackendFailed("ended", "stream ended before the request finished")
                    out += self._close_finished()  # ended cleanly without [DONE]: complete it
                    return
            finally:
                if out:
                    yield b"".join(out)
            while True:  # reads of one plain token event each (a lone stream's) go the short way
                whole = await self.leg.next_whole(self.settings.stall_timeout_s, self._elsewhere)
                sent = led.relay_one(whole) if whole is not None else None
                if sent is None:
                    break
                yield sent
            evs, done, ended = self.leg.events_of(whole)

    def _events(self, evs: list, out: list[bytes]) -> bool:
        """Feed one read's events (payloads, or events parsed already) to the ledger, the client's
        bytes to `out`; True once the proxy itself ended the answer (a stop string across the cut)."""
        led = self.ledger
        at = led.relay(evs, out)  # plain token events: their bytes as they came
        while at < len(evs):
            ev = evs[at]
            for event in led.feed(ev if ev.__class__ is dict else parse(ev)):
                if self.failed_at is not None:
                    gap = time.monotonic() - self.failed_at
                    self.metrics.migration_gap.observe(gap)
                    log.info("migration resumed", request_id=self.request_id, gap_ms=round(gap * 1000, 1))
                    self.failed_at = None
                if led.stream:
                    out.append(encode(event))
            if led.stopped:
                return True
            at += 1
            at += led.relay(evs, out, at)
        return False

    def _close_finished(self) -> list[bytes]:
        """The engine sent the last token and died before its usage event and [DONE]."""
        led = self.ledger
        if led.fingerprint is None:  # vLLM sends it with the usage event: the engine's from an earlier answer
            led.fingerprint = self.leg.instance.fingerprint
            if led.final is not None and led.fingerprint is not None:
                led.final["system_fingerprint"] = led.fingerprint
        out = [encode(e) for e in led.flush_final()]
        if led.usage is None:
            prompt, done = len(led.prompt_ids or ()), len(led.generated)
            led.usage = {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}
            if led.want_usage:
                fingerprint = {"system_fingerprint": led.fingerprint} if led.fingerprint is not None else {}
                out.append(encode({**led.head, "choices": [], **fingerprint, "usage": led.usage}))
        return out + [DONE] if led.stream else []

    async def _migrate(self, failed: Instance, reason: str) -> None:
        led = self.ledger
        if led.mode == "replay":
            led.cut("")
            return await self._open_next(failed, reason)
        helper = self.pick(self.role, frozenset({failed.url}))  # any live instance of the model detokenizes
        full = await self.detokenize(helper, list(led.prompt_ids or ()) + led.generated)
        if full is not None and not self.base and led.prompt_ids:
            self.base = await self.detokenize(helper, list(led.prompt_ids)) or ""
        recovered = ""
        if full is not None and full.startswith(self.base):
            generated_text = full[len(self.base):]
            recovered = led.unsent_text(generated_text)
            # vLLM primes the continuation's detokenizer with its prompt; when that prompt's text
            # ends in an incomplete (or invalid) character, the first text it sends is the whole
            # prompt's text again (tokenizers' DecodeStream, 0.23)
            self.fixing = generated_text.endswith("\ufffd")
            self.cut_text = generated_text.rstrip("\ufffd")
        led.cut(recovered)
        await self._open_next(failed, reason)

    async def _open_next(self, failed: Instance, reason: str) -> None:
        led = self.ledger
        # any live instance but the one that just failed (one that failed earlier may serve again:
        # a dead one is ejected by its health check by then)
        tracing.migration(reason, failed.url, len(led.generated))
        self.leg, self.pending, self.pending_done = await self.open_leg(self.role, led.continuation(),
                                                                        frozenset({failed.url}))
        self.metrics.migrations.labels(self.role, reason).inc()
        log.warning("request migrated", request_id=self.request_id, role=self.role, reason=reason,
                    from_=failed.url, to=self.leg.instance.url, tokens=len(led.generated), migration=led.migrations)

    async def _fix_text(self, ev: dict, before: list[int]) -> None:
        """The first non-empty text of a continuation whose detokenizer was primed with an
        incomplete character repeats the prompt: its text is what the generated tokens' text
        gained with this event (from /detokenize, as at the cut), as the uninterrupted stream
        would have sent it once the character was complete. The text ends where the engine's
        did: at the event's last token whose text does not end in an incomplete character (vLLM
        holds those back; when its API server falls behind, one event carries several tokens,
        and the ones after that point come in a later event's text)."""
        choices = ev.get("choices")
        if not self.fixing or not choices or not (choices[0].get("text") or ""):
            return
        self.fixing = False
        led = self.ledger
        ids = list(led.prompt_ids or ()) + led.generated + before + list(choices[0].get("token_ids") or ())
        first = len(ids) - len(choices[0].get("token_ids") or ())
        full = None
        for end in range(len(ids), first, -1):  # most often the first try
            full = await self.detokenize(self.leg.instance, ids[:end])
            if full is None or not full.endswith("\ufffd"):
                break
        if full is None or full.endswith("\ufffd") or not full.startswith(self.base) \
                or not full[len(self.base):].startswith(self.cut_text):
            log.warning("continuation text not checked: /detokenize did not agree", request_id=self.request_id)
            return
        choices[0]["text"] = full[len(self.base) + len(self.cut_text):]


def parse(payload: bytes) -> dict:
    """One event's payload, decoded; BackendFailed when it is not a JSON object."""
    try:
        event = _decode(payload)
    except msgspec.DecodeError as exc:
        raise BackendFailed("error_event", f"an event that is not JSON: {exc}") from None
    if event.__class__ is not dict:
        raise BackendFailed("error_event", f"an event that is not a JSON object: {payload[:100]!r}")
    return event


_decode = msgspec.json.Decoder().decode
