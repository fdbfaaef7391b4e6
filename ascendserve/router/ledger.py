"""The token ledger of one relayed generation, and the splice of a continuation onto it.

For every request it can continue elsewhere (`why_not_migratable` is None) the proxy asks the
decode/pd engine for a stream with the token ids (`return_token_ids`) and the usage, whatever the
client asked, and learns from it the prompt's and every generated token id. What the client gets
is what plain vLLM would have sent it: the fields it did not ask for are stripped, and a
non-streaming request is answered with one JSON body assembled from the stream.

When the engine fails before the request is finished, `continuation()` is a token-id completion
(prompt + the tokens generated so far, the tokens that remain, the same sampling parameters) for
another instance, and `feed()` splices its events onto the client's response: the same id,
`created` and choice index, the text offsets of logprobs continued, chat chunks rebuilt from the
completion events (a chat continues as token ids: no template is applied twice), one final
`finish_reason`, and the usage of the whole request (prompt counted once). The text vLLM held back
at the cut (it keeps the last len(stop) - 1 characters while a stop string may still match) is
recovered through the engine's /detokenize (`recover()`), and a stop string that straddles the
cut still ends the answer.

Requests it cannot continue token-exactly are relayed as before (an error event if the engine dies
mid-stream): n > 1 or several prompts, echo, tools, structured outputs, and a chat whose engine
parses reasoning or tool calls (seen in the stream).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec

from ascendserve.protocol.openai import mm_parts

# Sampling/output keys of a chat request that a completion does not take, or takes differently.
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
              "add_generation_prompt", "continue_final_message", "documents", "top_logprobs", "logprobs",
              "max_completion_tokens", "response_format", "reasoning_effort", "include_reasoning",
              "mm_processor_kwargs", "return_prompt_text", "functions", "function_call")
_NEVER_CONTINUED = ("prompt_logprobs", "truncate_prompt_tokens", "kv_transfer_params", "ec_transfer_params",
                    "stream_options", "echo", "suffix", "n", "best_of")
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "response_format")


class BackendFailed(Exception):
    """The engine's stream broke: an error event, or it ended before the request finished."""

    def __init__(self, reason: str, detail: str, status: int | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.status = reason, detail, status


def mode_of(kind: str, body: dict) -> str | None:
    """How a request that breaks mid-generation is continued: "tokens" (a token-id completion of
    what remains), "replay" (multimodal: a token-id prompt cannot carry the images, so the request
    is run again from the start and the tokens the client has are skipped; only when it is
    deterministic: greedy or seeded), or None (it ends with an error event)."""
    if why_not_migratable(kind, body) is not None:
        return None
    if kind == "chat" and mm_parts(body):
        return "replay" if body.get("temperature") == 0 or body.get("seed") is not None else None
    return "tokens"


def why_not_migratable(kind: str, body: dict) -> str | None:
    """None when a failure mid-generation can be continued token-exactly elsewhere; else why not."""
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "n > 1"
    if body.get("echo"):
        return "echo"
    for key in _STRUCTURED:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return "structured output"
    if kind == "chat":
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tools"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        return None
    return "several prompts"


def error_of(event: dict) -> tuple[str, int | None] | None:
    """An OpenAI error event's message and status (None: not an error event)."""
    if "error" not in event and event.get("object") != "error":
        return None
    err = event["error"] if isinstance(event.get("error"), dict) else event
    code = err.get("code")
    status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else None
    return str(err.get("message", err))[:300], status


def backend_body(body: dict) -> dict:
    """What the engine is asked for: a stream with the token ids and the usage."""
    options = body.get("stream_options") if body.get("stream") is True else None
    continuous = bool(isinstance(options, dict) and options.get("continuous_usage_stats"))
    return dict(body, stream=True, return_token_ids=True,
                stream_options={"include_usage": True, **({"continuous_usage_stats": True} if continuous else {})})


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop if isinstance(s, str) and s) if isinstance(stop, list) else ()


@dataclass
class Ledger:
    kind: str  # chat | completions
    body: dict  # the client's request
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)  # the text (content) sent to the client, or assembled for it
    finish_reason: str | None = None
    stop_reason: object = None
    usage: dict | None = None
    head: dict = field(default_factory=dict)  # id, object, created, model of the client's response
    migrations: int = 0
    leg_base: int = 0  # tokens generated before the current leg (0 on the first)
    next_offset: int = 0  # completions logprobs: text_offset of the next token
    leg_offset: int = 0  # ... when the current leg began (its own offsets start at 0)
    held: str = ""  # text recovered at a cut that may begin a stop string: not sent yet
    tail: str = ""  # the last characters sent before a cut, where a stop string may begin (include_stop)
    logprobs: list = field(default_factory=list)  # non-streaming: every event's logprobs, to join
    not_migratable: str | None = None  # learned from the stream (a reasoning or tool parser)
    fingerprint: str | None = None  # the engine's system_fingerprint
    final: dict | None = None  # the terminal event, held until the usage event stamps it
    stopped: bool = False  # a stop string across the cut ended the answer; the engine does not know
    mode: str = "tokens"  # how a cut is continued (mode_of)
    skip_ids: int = 0  # replay: tokens of the new leg the client already has
    skip_text: int = 0  # replay: characters of the new leg's text the client already has
    strip_details: bool = False  # the engine reports prompt_tokens_details because we asked (KV routing)
    engine_usage: dict | None = None  # the first leg's usage as the engine sent it (its cached_tokens)

    def __post_init__(self):
        self.stream = self.body.get("stream") is True
        self.want_ids = bool(self.body.get("return_token_ids"))
        options = self.body.get("stream_options") if self.stream else None
        self.want_usage = not self.stream or bool(isinstance(options, dict) and options.get("include_usage"))
        logprobs = self.body.get("logprobs")
        # every event of these carries logprobs or usage: relay() would only decode them to give them to feed()
        self.plain = (logprobs is None or logprobs is False) and not (
            isinstance(options, dict) and options.get("continuous_usage_stats"))
        self.stops = _stops(self.body)
        self.include_stop = bool(self.body.get("include_stop_str_in_output"))
        self.limit = self.body.get("max_tokens") if self.kind == "completions" else \
            self.body.get("max_completion_tokens", self.body.get("max_tokens"))

    @property
    def text(self) -> str:
        """The text so far. Kept in parts: `+=` on an attribute copies the whole string each time,
        which for a 64k-token answer was seconds of the proxy's CPU."""
        parts = self.text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    # ---- the engine's events -> the client's ---------------------------------
    @property
    def on_continuation(self) -> bool:
        return self.migrations > 0

    def feed(self, event: dict) -> list[dict]:
        """One parsed event of the current leg; the events the client gets for it (maybe none).
        Raises BackendFailed on an error event. (The happy path's cost is bench/proxy.py's
        "x no ledger": keep it lean.)"""
        choices = event.get("choices")
        if choices.__class__ is not list:
            error = error_of(event)
            if error is not None:
                raise BackendFailed("error_event", error[0], error[1])
            return []
        if not self.head:
            self.head = {k: event[k] for k in ("id", "object", "created", "model") if k in event}
        if not choices:  # the usage event (choices [])
            return self._usage_event(event)
        choice = choices[0]
        if self.migrations and self.mode == "replay":
            return self._replayed(event, choice)
        if self.prompt_ids is None:
            ids = event.get("prompt_token_ids") if self.kind == "chat" else choice.get("prompt_token_ids")
            if isinstance(ids, list):
                self.prompt_ids = ids
        ids = choice.get("token_ids")
        if ids:
            self.generated += ids
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        if self.migrations:
            return self._continued(event, choice)
        if self.kind == "chat":
            delta = choice.get("delta") or {}
            if len(delta) > 1 or "content" not in delta:  # anything but plain content
                if delta.get("tool_calls") or delta.get("reasoning") or delta.get("reasoning_content"):
                    self.not_migratable = "the engine parses reasoning or tool calls"
            content = delta.get("content")
            if content:
                self.text_parts.append(content)
        else:
            text = choice.get("text")
            if text:
                self.text_parts.append(text)
            if choice.get("logprobs") is not None:
                self._advance_offset(choice["logprobs"])
        return self._to_client(event, choice)

    def relay(self, evs: list, out: list[bytes], start: int = 0) -> int:
        """feed()'s fast path, for the run of `evs` from `start` (raw payloads of one read) that are plain
        token events of the first leg: one typed decode of the run (msgspec, the few fields the ledger
        needs) tells their ids and text, and the client gets the engine's very bytes (token ids nulled
        in place when it did not ask for them) appended to `out`, with no decode into dicts and no
        re-encoding. Returns how many it took; feed() takes the rest (an item that is not bytes, the
        first event, usage and error events, a role or tool chunk, a terminal event held for its
        fingerprint, anything that does not decode as expected, a continuation, and every event of a
        request for logprobs or continuous usage stats)."""
        if not self.plain or self.migrations or not self.head:
            return 0
        n, end = start, len(evs)
        while n < end and evs[n].__class__ is bytes:
            n += 1
        if n == start:
            return 0
        run = evs[start:n]
        try:
            decoded = _decode_run(b"[" + b",".join(run) + b"]") if len(run) > 1 else [_decode_token(run[0])]
        except msgspec.DecodeError:  # ValidationError is one: some event is not a token's
            decoded = []
            for payload in run:  # those before it
                try:
                    decoded.append(_decode_token(payload))
                except msgspec.DecodeError:
                    break
        taken = 0
        for ev in decoded:
            if not self._take(ev, run[taken]):
                break
            taken += 1
        if taken and self.stream:
            joined = b"data: " + b"\n\ndata: ".join(run[:taken] if taken < len(run) else run) + b"\n\n"
            out.append(_NULL_IDS(b'token_ids":null', joined) if not self.want_ids else joined)
        return taken

    def relay_one(self, whole: bytes) -> bytes | None:
        """relay() for a read of exactly one event as the engine sent it (`data: {...}\n\n`, the
        usual read of a lone stream), without splitting it into payloads and joining it again: the
        client's bytes when it is a plain token event of a first leg's stream, else None (the read
        then goes the general way; the ledger is as it was)."""
        if not self.plain or self.migrations or not self.head or not self.stream \
                or whole.count(b"\n") != 2 or not whole.startswith(b"data: {"):
            return None
        payload = whole[6:-2]
        try:
            ev = _decode_token(payload)
        except msgspec.DecodeError:
            return None
        if not self._take(ev, payload):
            return None
        return _NULL_IDS(b'token_ids":null', whole) if not self.want_ids else whole

    def _take(self, ev: _Token, payload: bytes) -> bool:
        """One decoded event (relay's typed decode of `payload`) into the ledger when it is a plain
        token event; False, and nothing changed, when it is not."""
        if ev.usage is not None or len(ev.choices) != 1:
            return False
        choice = ev.choices[0]
        finish = choice.finish_reason
        if finish is not None and not self.want_usage:
            return False  # held until the usage event stamps it (_to_client)
        if self.kind == "chat":
            delta = choice.delta
            if delta.__class__ is not dict or len(delta) != 1 or "content" not in delta:
                return False
            text = delta["content"]
            prompt_ids = ev.prompt_token_ids
        else:
            text = choice.text
            prompt_ids = choice.prompt_token_ids
        ids = choice.token_ids
        if not self.want_ids and payload.count(b'token_ids":[') != \
                (ids is not None) + (ev.prompt_token_ids is not None) + (choice.prompt_token_ids is not None):
            return False  # another key ending in token_ids: feed() edits only ours
        if text:
            self.text_parts.append(text)
        if ids:
            self.generated += ids
        if self.prompt_ids is None and prompt_ids is not None:
            self.prompt_ids = prompt_ids
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, choice.stop_reason
        if ev.system_fingerprint is not msgspec.UNSET:
            self.fingerprint = ev.system_fingerprint
        return True

    def _advance_offset(self, logprobs) -> None:
        if isinstance(logprobs, dict) and logprobs.get("tokens"):
            self.next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def _to_client(self, event: dict, choice: dict) -> list[dict]:
        if "system_fingerprint" in event:
            self.fingerprint = event["system_fingerprint"]
        if not self.stream:
            if choice.get("logprobs") is not None:
                self.logprobs.append(choice["logprobs"])
            if event.get("usage"):
                self.usage = event["usage"]
            return []
        if not self.want_ids:  # vLLM sends these keys as null when they were not asked for
            if "token_ids" in choice:
                choice["token_ids"] = None
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
            if "prompt_token_ids" in event:
                event["prompt_token_ids"] = None
            if self.kind == "chat" and not choice.get("delta") and choice.get("finish_reason") is None \
                    and choice.get("logprobs") is None and "delta" in choice:
                return []  # sent only because token ids were asked for
        if choice.get("finish_reason") is not None and not self.want_usage:
            self.final = event  # vLLM stamps its fingerprint here when no usage event follows: wait for it
            return []
        return [event]

    def flush_final(self) -> list[dict]:
        """The held terminal event, when the usage event that would stamp it never came."""
        final, self.final = self.final, None
        return [final] if final is not None else []

    def _usage_event(self, event: dict) -> list[dict]:
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = self._whole(usage)
            event["usage"] = self.usage
        if "system_fingerprint" in event:
            self.fingerprint = event["system_fingerprint"]
        if self.head:
            event.update(self.head)
        if not self.stream:
            return []
        if self.want_usage:
            return [event]
        if self.final is not None and self.fingerprint is not None:
            self.final["system_fingerprint"] = self.fingerprint
        return self.flush_final()

    def _whole(self, usage: dict) -> dict:
        """Usage of the whole request: the original prompt once, every generated token."""
        if self.engine_usage is None:
            self.engine_usage = usage
        if self.strip_details and usage.get("prompt_tokens_details") is not None:
            usage = dict(usage, prompt_tokens_details=None)  # vLLM's null: the client did not turn it on
        if not self.on_continuation or self.mode == "replay":
            return usage
        prompt = len(self.prompt_ids or ())
        done = self.leg_base + int(usage.get("completion_tokens") or 0)
        return dict(usage, prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)

    # ---- a replay's events ---------------------------------------------------------
    def _replayed(self, event: dict, choice: dict) -> list[dict]:
        """The same request run again: what the client has is skipped (its tokens must be the
        same: BackendFailed "diverged" when not), the rest relayed as from the first leg."""
        ids = list(choice.get("token_ids") or ())
        if self.skip_ids:
            seen = ids[:self.skip_ids]
            start = len(self.generated) - self.skip_ids
            if seen != self.generated[start:start + len(seen)]:
                raise BackendFailed("diverged", "the replayed request generated other tokens", None)
            self.skip_ids -= len(seen)
            ids = ids[len(seen):]
        text_key = "text" if self.kind == "completions" else None
        delta = choice.get("delta") if self.kind == "chat" else None
        if self.kind == "chat" and isinstance(delta, dict) and "role" in delta:
            return []  # the client has its role chunk
        text = (choice.get("text") if text_key else (delta or {}).get("content")) or ""
        if self.skip_text:
            cut = min(self.skip_text, len(text))
            self.skip_text -= cut
            text = text[cut:]
        if not ids and not text and choice.get("finish_reason") is None:
            return []
        self.generated.extend(ids)
        self.text_parts.append(text)
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        out = dict(choice, token_ids=ids)
        if text_key:
            out["text"] = text
        else:
            out["delta"] = dict(delta or {}, content=text)
        if "prompt_token_ids" in out:
            out["prompt_token_ids"] = None
        event = dict(event, id=self.head.get("id"), created=self.head.get("created"), choices=[out])
        if self.kind == "chat" and "prompt_token_ids" in event:
            event["prompt_token_ids"] = None
        return self._to_client(event, out)

    # ---- a continuation's events ------------------------------------------------
    def _continued(self, event: dict, choice: dict) -> list[dict]:
        text = choice.get("text") or ""
        ids = choice.get("token_ids") or []
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        if self.held or self.tail:
            text, hit = self._scan(text, finish is not None)
            if hit is not None:  # the engine goes on: the proxy ends the answer here (Generation)
                finish, stop_reason = "stop", hit
                self.finish_reason, self.stop_reason = finish, stop_reason
                self.stopped = True
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("text_offset") is not None:
            logprobs = dict(logprobs, text_offset=[o + self.leg_offset for o in logprobs["text_offset"]])
            self._advance_offset(logprobs)
        self.text_parts.append(text)
        if self.kind == "chat":
            top = int(self.body.get("top_logprobs") or 0)
            out = self._chat_choice(text, _chat_logprobs(logprobs, top), ids, finish, stop_reason)
            event = {"id": self.head.get("id"), "object": "chat.completion.chunk",
                     "created": self.head.get("created"), "model": self.head.get("model"), "choices": [out]}
        else:
            out = dict(choice, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)
            if "prompt_token_ids" in out:
                out["prompt_token_ids"] = None  # the client had the prompt's ids from the first leg
            event = dict(event, id=self.head.get("id"), created=self.head.get("created"), choices=[out])
        if isinstance(event.get("usage"), dict):
            event["usage"] = self._whole(event["usage"])
        if not text and finish is None and not ids:
            return []
        return self._to_client(event, out)

    def _chat_choice(self, text: str, logprobs, ids: list[int], finish, stop_reason) -> dict:
        out: dict = {"index": 0, "delta": {"content": text}, "logprobs": logprobs,
                     "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = stop_reason
        out["token_ids"] = ids
        return out

    def _scan(self, text: str, finished: bool) -> tuple[str, str | None]:
        """The continuation's new text -> the text to send now, and the stop string that matched
        when one begins before the cut (vLLM checks only the continuation's own text). It may
        begin in the text vLLM held back (`held`, not sent yet) or, when the stop string is
        included in the output (vLLM holds nothing back then), in the last characters sent
        (`tail`). Text is held while a stop string may still begin in it."""
        joined = self.tail + self.held + text
        sent, region = len(self.tail), len(self.tail) + len(self.held)
        if region == 0:
            return text, None
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = joined.find(stop)
            if 0 <= at < region and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None or finished:
            self.tail = self.held = ""
            if best is None:
                return joined[sent:], None
            at, stop = best
            return joined[sent:max(sent, at + (len(stop) if self.include_stop else 0))], stop
        keep = len(joined)  # the first position of the region where a stop string may still begin
        for at in range(region):
            rest = joined[at:]
            if any(s.startswith(rest) for s in self.stops if len(s) > len(rest)):
                keep = at
                break
        self.tail, self.held = joined[min(keep, sent):sent], joined[max(keep, sent):]
        return joined[sent:max(keep, sent)], None

    # ---- migration ------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining(self) -> int | None:
        if not isinstance(self.limit, int):
            return None
        return self.limit - len(self.generated)

    def continuation(self) -> dict:
        """The completion request that continues this one on another instance (token ids in),
        or for a replay the request itself again."""
        if self.mode == "replay":
            body = {k: v for k, v in self.body.items() if k not in ("kv_transfer_params", "ec_transfer_params")}
            return backend_body(body)
        drop = _NEVER_CONTINUED + (_CHAT_ONLY if self.kind == "chat" else ())
        body = {k: v for k, v in self.body.items() if k not in drop}
        body["prompt"] = list(self.prompt_ids or ()) + self.generated
        left = self.remaining()
        if left is not None:
            body["max_tokens"] = left
        if isinstance(self.body.get("min_tokens"), int):
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        if self.kind == "chat" and self.body.get("logprobs"):
            body["logprobs"] = int(self.body.get("top_logprobs") or 0)
        if self.kind == "chat":  # chat decodes with special tokens skipped unless told otherwise: the same
            body.setdefault("skip_special_tokens", True)
        body.update(stream=True, return_token_ids=True, stream_options=backend_body(self.body)["stream_options"])
        return body

    def cut(self, recovered: str) -> None:
        """Start a continuation leg; `recovered`: the generated text vLLM held back at the cut."""
        self.migrations += 1
        if self.mode == "replay":
            self.skip_ids, self.skip_text = len(self.generated), len(self.text)
            return
        self.leg_base = len(self.generated)
        self.leg_offset = self.next_offset
        self.held += recovered
        if self.include_stop and self.stops:  # vLLM held nothing back: a stop may begin in what was sent
            self.tail = self.text[-(max(map(len, self.stops)) - 1):] if max(map(len, self.stops)) > 1 else ""

    def unsent_text(self, full: str) -> str:
        """The text of every generated token (`full`, from /detokenize) that the client has not got
        (vLLM held it back for a stop string); an incomplete character at the end is left to the
        continuation, whose detokenizer is primed with these tokens."""
        if not full.startswith(self.text):
            return ""
        return full[len(self.text):].rstrip("\ufffd")

    # ---- a non-streaming answer ---------------------------------------------------
    def response(self) -> dict:
        """The JSON body vLLM answers a non-streaming request with (vLLM 0.32's fields), from the stream."""
        usage = dict(self.usage or {})
        usage.setdefault("prompt_tokens_details", None)
        usage.setdefault("completion_tokens_details", None)
        ids, prompt_ids = (self.generated, self.prompt_ids) if self.want_ids else (None, None)
        head = {"id": self.head.get("id"), "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.head.get("created"), "model": self.head.get("model")}
        tail = {"service_tier": None, "system_fingerprint": self.fingerprint, "usage": usage}
        if self.kind == "chat":
            message = {"role": "assistant", "content": self.text, "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "reasoning": None}
            choice = {"index": 0, "message": message, "logprobs": _joined_chat_logprobs(self.logprobs),
                      "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "token_ids": ids,
                      "routed_experts": None}
            return {**head, "choices": [choice], **tail, "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
                    "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        choice = {"index": 0, "text": self.text, "logprobs": _joined_logprobs(self.logprobs),
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "token_ids": ids,
                  "prompt_logprobs": None, "prompt_token_ids": prompt_ids, "routed_experts": None}
        return {**head, "choices": [choice], **tail, "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}


def _chat_logprobs(logprobs, top: int) -> dict | None:
    """A completion's logprobs as a chat chunk gives them (token, logprob, bytes, the `top` first
    top_logprobs). The completions API keys top logprobs by text: two top tokens that decode to the
    same text arrive as one (README: what a continued chat's logprobs may lack)."""
    if not isinstance(logprobs, dict):
        return logprobs
    content = []
    tops = logprobs.get("top_logprobs") or []
    for i, (token, lp) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [])):
        alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode("utf-8", "replace")),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                                         for t, v in list(alts.items())[:top]]})
    return {"content": content}


def _joined_chat_logprobs(parts: list) -> dict | None:
    if not parts:
        return None
    return {"content": [c for p in parts if isinstance(p, dict) for c in (p.get("content") or ())]}


def _joined_logprobs(parts: list) -> dict | None:
    if not parts:
        return None
    out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for p in parts:
        for key in out:
            out[key].extend(p.get(key) or ())
    return out


class _Choice(msgspec.Struct):
    """What Ledger.relay reads of a token event's choice; a field of another type fails the decode."""
    text: str | None = None
    delta: dict | None | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: None = None  # a request for logprobs never takes relay()


class _Token(msgspec.Struct):
    choices: list[_Choice]  # an error event has none: feed() raises it
    prompt_token_ids: list[int] | None = None
    usage: dict | None = None  # the usage event (the last of a read, most often) decodes, and stops the run
    system_fingerprint: str | None | msgspec.UnsetType = msgspec.UNSET


_decode_token = msgspec.json.Decoder(_Token).decode
_decode_run = msgspec.json.Decoder(list[_Token]).decode
_NULL_IDS = re.compile(rb'token_ids":\[[^\]]*\]').sub  # a literal prefix: re finds it at memchr's pace
