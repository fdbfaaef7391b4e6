"""The token ledger (router/ledger.py): what the engine is asked, what the client gets, and the
continuation after a cut. Events are shaped as vLLM 0.32 sends them (recorded from the tiny
model through its OpenAI server); tests/integration/test_migration_splice.py checks the same
against a real engine."""

from __future__ import annotations

import time

import msgspec
import pytest

from ascendserve.router.ledger import BackendFailed, Ledger, backend_body, mode_of, why_not_migratable
from ascendserve.router.sse import encode, payloads

MODEL = "m"


def cmpl(text: str, ids: list[int], finish=None, prompt_ids=None, logprobs=None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 10, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": prompt_ids, "token_ids": ids}]}


def chat(content: str | None, ids: list[int], finish=None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({} if content is None else {"content": content})
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if not role:
        choice["token_ids"] = ids
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 10, "model": MODEL, "choices": [choice]}
    if role:
        event |= {"prompt_token_ids": [1, 2, 3], "prompt_text": None}
    return event


def usage(prompt: int, done: int, obj: str = "text_completion") -> dict:
    return {"id": "cmpl-1", "object": obj, "created": 10, "model": MODEL, "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done},
            "system_fingerprint": "vllm-0.32.0-x"}


@pytest.mark.parametrize("kind, body, why", [
    ("completions", {"prompt": "a"}, None),
    ("completions", {"prompt": [1, 2]}, None),
    ("completions", {"prompt": ["one"]}, None),
    ("completions", {"prompt": ["one", "two"]}, "several prompts"),
    ("completions", {"prompt": [[1], [2]]}, "several prompts"),
    ("completions", {"prompt": "a", "n": 2}, "n > 1"),
    ("completions", {"prompt": "a", "echo": True}, "echo"),
    ("completions", {"prompt": "a", "structured_outputs": {"json": {}}}, "structured output"),
    ("chat", {"messages": []}, None),
    ("chat", {"messages": [], "response_format": {"type": "text"}}, None),
    ("chat", {"messages": [], "response_format": {"type": "json_object"}}, "structured output"),
    ("chat", {"messages": [], "tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}, None),
])
def test_which_requests_can_be_continued(kind, body, why):
    assert why_not_migratable(kind, body) == why


def test_the_engine_is_asked_for_a_stream_with_token_ids_and_usage():
    assert backend_body({"prompt": "a"}) == {"prompt": "a", "stream": True, "return_token_ids": True,
                                             "stream_options": {"include_usage": True}}
    b = backend_body({"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_a_client_that_asked_for_nothing_gets_vllms_nulls_and_no_usage_event():
    led = Ledger("completions", {"prompt": "a", "stream": True, "max_tokens": 2})
    first = led.feed(cmpl("x", [7], prompt_ids=[1, 2]))
    assert first[0]["choices"][0]["token_ids"] is None and first[0]["choices"][0]["prompt_token_ids"] is None
    assert led.feed(cmpl("y", [8], finish="length")) == []  # held: vLLM stamps its fingerprint here
    out = led.feed(usage(2, 2))
    assert [e["choices"][0]["finish_reason"] for e in out] == ["length"]
    assert out[0]["system_fingerprint"] == "vllm-0.32.0-x" and "usage" not in out[0]
    assert led.prompt_ids == [1, 2] and led.generated == [7, 8] and led.text == "xy"


def test_a_client_that_asked_for_ids_and_usage_gets_them():
    led = Ledger("completions", {"prompt": "a", "stream": True, "max_tokens": 1, "return_token_ids": True,
                                 "stream_options": {"include_usage": True}})
    out = led.feed(cmpl("x", [7], finish="length", prompt_ids=[1, 2]))
    assert out[0]["choices"][0]["token_ids"] == [7] and out[0]["choices"][0]["prompt_token_ids"] == [1, 2]
    assert led.feed(usage(2, 1))[0]["usage"]["completion_tokens"] == 1


def test_chat_chunks_sent_only_for_token_ids_are_dropped():
    led = Ledger("chat", {"messages": [], "stream": True})
    role = led.feed(chat(None, [], role=True))
    assert role[0]["prompt_token_ids"] is None and led.prompt_ids == [1, 2, 3]
    assert led.feed(chat(None, [5])) == []  # a parser's silent token: vLLM sends nothing without ids
    assert led.feed(chat("hi", [6]))[0]["choices"][0]["token_ids"] is None
    assert led.generated == [5, 6]


def test_an_error_event_is_a_failure_with_its_status():
    led = Ledger("completions", {"prompt": "a", "stream": True})
    with pytest.raises(BackendFailed) as failed:
        led.feed({"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}})
    assert failed.value.status == 500 and failed.value.reason == "error_event"


def test_a_chat_continues_as_token_ids_with_what_remains():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10,
            "max_tokens": 99, "min_tokens": 5, "logprobs": True, "top_logprobs": 2, "stop": ["zz"], "seed": 3,
            "stream": True, "temperature": 0.5, "kv_transfer_params": {"x": 1}}
    led = Ledger("chat", body)
    led.feed(chat(None, [], role=True))
    led.feed(chat("ab", [4, 5]))
    led.cut("")
    c = led.continuation()
    assert c["prompt"] == [1, 2, 3, 4, 5] and c["max_tokens"] == 8 and c["min_tokens"] == 3
    assert c["logprobs"] == 2 and c["stop"] == ["zz"] and c["seed"] == 3 and c["temperature"] == 0.5
    assert c["stream"] is True and c["return_token_ids"] is True
    assert not {"messages", "max_completion_tokens", "top_logprobs", "kv_transfer_params"} & set(c)


def test_a_continuation_is_spliced_onto_the_first_leg():
    led = Ledger("chat", {"messages": [], "stream": True, "max_tokens": 4,
                          "stream_options": {"include_usage": True}})
    led.feed(chat(None, [], role=True))
    led.feed(chat("ab", [4]))
    led.cut("")
    out = led.feed(cmpl("cd", [9], prompt_ids=[1, 2, 3, 4]) | {"id": "cmpl-2", "created": 99})
    assert out == [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 10, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "cd"}, "logprobs": None, "finish_reason": None,
                                 "token_ids": None}]}]
    led.feed(cmpl("e", [10, 11], finish="length"))
    last = led.feed(usage(4, 3) | {"id": "cmpl-2"})[0]
    assert last["id"] == "chatcmpl-1" and last["object"] == "chat.completion.chunk"
    assert last["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}
    assert led.generated == [4, 9, 10, 11] and led.text == "abcde"


def test_completion_logprob_offsets_go_on_across_the_cut():
    lp = lambda tok, off: {"text_offset": [off], "token_logprobs": [-1.0], "tokens": [tok], "top_logprobs": [{tok: -1.0}]}
    led = Ledger("completions", {"prompt": "a", "stream": True, "logprobs": 0})
    led.feed(cmpl("ab", [4], logprobs=lp("ab", 0)))
    led.cut("")
    out = led.feed(cmpl("c", [5], logprobs=lp("c", 0)))
    assert out[0]["choices"][0]["logprobs"]["text_offset"] == [2]
    out = led.feed(cmpl("d", [6], logprobs=lp("d", 1)))
    assert out[0]["choices"][0]["logprobs"]["text_offset"] == [3]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_the_cut_ends_the_answer(include):
    led = Ledger("completions", {"prompt": "a", "stream": True, "stop": ["XYZ"], "include_stop_str_in_output": include})
    led.feed(cmpl("ab" if not include else "abX", [4]))  # vLLM held "X" back unless it is included
    led.cut("X" if not include else "")
    texts = lambda out: [e["choices"][0]["text"] for e in out]
    assert texts(led.feed(cmpl("", [5]))) == [""]  # the token's event, as vLLM sends one while it holds text
    assert texts(led.feed(cmpl("Y", [6]))) == [""]  # "XY" may still begin "XYZ": held
    assert led.feed(cmpl("Zq", [7])) == []  # stopped: the terminal event waits for the usage
    assert led.stopped and led.finish_reason == "stop" and led.stop_reason == "XYZ"
    final = led.flush_final()[0]["choices"][0]
    assert final["text"] == ("YZ" if include else "") and final["finish_reason"] == "stop"
    assert led.text == ("abXYZ" if include else "ab")


def test_held_text_that_cannot_begin_a_stop_string_is_sent():
    led = Ledger("completions", {"prompt": "a", "stream": True, "stop": ["XYZ"]})
    led.feed(cmpl("ab", [4]))
    led.cut("XY")
    out = led.feed(cmpl("q", [5]))
    assert out[0]["choices"][0]["text"] == "XYq" and not led.stopped and led.held == ""


def test_a_non_streaming_answer_has_vllms_fields_in_vllms_order():
    led = Ledger("completions", {"prompt": "a", "max_tokens": 2})
    led.feed(cmpl("x", [7], prompt_ids=[1]))
    led.feed(cmpl("y", [8], finish="length"))
    led.feed(usage(1, 2))
    body = led.response()
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                          "kv_transfer_params", "ec_transfer_params", "metrics"]
    assert list(body["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                        "prompt_logprobs", "prompt_token_ids", "routed_experts"]
    assert body["choices"][0]["text"] == "xy" and body["choices"][0]["token_ids"] is None
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    led = Ledger("chat", {"messages": [], "return_token_ids": True})
    led.feed(chat(None, [], role=True))
    led.feed(chat("hi", [5], finish="stop"))
    led.feed(usage(3, 1, "chat.completion.chunk"))
    body = led.response()
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                          "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                          "ec_transfer_params", "metrics"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    assert body["choices"][0]["token_ids"] == [5] and body["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize("data, want", [
    (b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n', ([b'{"a": 1}', b'{"b": 2}'], True)),  # vLLM's
    (b'data: {"a": 1}\n\n', ([b'{"a": 1}'], False)),
    (b'data: [DONE]\n\n', ([], True)),
    (b'data: {"a": 1}\n\ndata:{"b": 2}\r\n\n: a comment\n\ndata: [DONE]\n\n', ([b'{"a": 1}', b'{"b": 2}'], True)),
    (b'data: {"a": 1}\n\ndata: \n\ndata: {"b": 2}\n\n', ([b'{"a": 1}', b'{"b": 2}'], False)),  # an empty one
    (b'data: {"a": 1}\nid: 7\n\n', ([b'{"a": 1}'], False)),  # another field in the event
    (b'data: [DONE]\n\ndata: {"a": 1}\n\n', ([b'{"a": 1}'], True)),
])
def test_sse_events_are_parsed_whole(data, want):
    assert payloads(data) == want


def _cmpl_stream() -> list[dict]:
    logprobs = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": ["d"], "top_logprobs": None}
    return [cmpl("a", [4], prompt_ids=[1, 2]), cmpl("b", [5]), cmpl("", [6]),  # text vLLM holds back
            cmpl("c", [7]) | {"system_fingerprint": "fp-1"}, cmpl("d", [8], logprobs=logprobs),
            cmpl("e", [9]) | {"usage": {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}},
            {**cmpl("f", [10]), "choices": [{**cmpl("f", [10])["choices"][0], "draft_token_ids": [3]}]},
            cmpl("g", [11], finish="length"), usage(2, 8)]


def _chat_stream() -> list[dict]:
    reasoning = chat("x", [9])
    reasoning["choices"][0]["delta"] = {"reasoning": "hm"}
    return [chat(None, [], role=True), chat("a", [4]), chat(None, [5]), chat("b", [6]), reasoning,
            chat("", [7]), chat("c", [8], finish="stop"), usage(3, 5, "chat.completion.chunk")]


def _relayed(kind: str, body: dict, evs: list[dict], per_read: int, fast: bool) -> tuple[bytes, dict, int, int]:
    """What the client gets, and the ledger's state, with events fed as Generation._leg feeds
    them (`fast`: a read of one raw event through relay_one(), the raw payloads of each other
    read through relay(), the rest through feed(); else every event decoded through feed()). The
    first event comes decoded, as _open_leg hands it on. Also: how many events took the fast
    ways, and how many of them relay_one()."""
    led = Ledger(kind, body)
    raw = [msgspec.json.encode(e) for e in evs]
    items: list = [msgspec.json.decode(raw[0])] + raw[1:]
    out: list[bytes] = []
    taken = ones = 0
    for start in range(0, len(items), per_read):
        read = items[start:start + per_read]
        if fast and len(read) == 1 and isinstance(read[0], bytes):
            sent = led.relay_one(b"data: " + read[0] + b"\n\n")
            if sent is not None:
                out.append(sent)
                taken, ones = taken + 1, ones + 1
                continue
        at = led.relay(read, out) if fast else 0
        taken += at
        while at < len(read):
            ev = read[at]
            for event in led.feed(ev if isinstance(ev, dict) else msgspec.json.decode(ev)):
                if led.stream:
                    out.append(encode(event))
            at += 1
            n = led.relay(read, out, at) if fast else 0
            taken, at = taken + n, at + n
    out += [encode(e) for e in led.flush_final()]
    state = {k: getattr(led, k) for k in ("generated", "text", "prompt_ids", "finish_reason", "stop_reason",
                                            "fingerprint", "not_migratable", "usage", "head", "final")}
    return b"".join(out), state, taken, ones


@pytest.mark.parametrize("per_read", [1, 3, 100])
@pytest.mark.parametrize("ask", [{"stream": True}, {"stream": True, "return_token_ids": True},
                                 {"stream": True, "stream_options": {"include_usage": True}},
                                 {"stream": True, "return_token_ids": True,
                                  "stream_options": {"include_usage": True}}, {},
                                 {"stream": True, "logprobs": 1},
                                 {"stream": True, "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}}])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_plain_token_events_are_relayed_as_their_bytes_exactly_as_feed_would_send_them(kind, ask, per_read):
    body = ({"prompt": "hi"} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}) | ask
    if kind == "chat" and "logprobs" in body:
        body["logprobs"] = True
    evs = _cmpl_stream() if kind == "completions" else _chat_stream()
    want, want_state, _, _ = _relayed(kind, body, evs, per_read, fast=False)
    got, state, taken, ones = _relayed(kind, body, evs, per_read, fast=True)
    assert got == want and state == want_state
    if "logprobs" in body or "continuous_usage_stats" in body.get("stream_options", {}):
        assert taken == 0  # every event carries them: all go through feed()
    else:
        assert taken >= 2  # plain token events did go the fast way
        if per_read == 1 and body.get("stream"):  # each alone in its read, as they come one a step
            assert ones == taken
    if body.get("stream") and not body.get("return_token_ids"):
        assert b'token_ids":[' not in got.replace(b'"draft_token_ids":[3]', b"")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_long_answer_is_followed_in_time_linear_in_its_length(kind):
    """200k tokens through relay() and feed(): the text kept as `+=` on an attribute copied all of
    it on every token (22 s here for this), now 0.4 s. A coarse bound."""
    body = ({"prompt": "hi"} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}) | \
        {"stream": True}
    make = (lambda i: cmpl("tok ", [i])) if kind == "completions" else (lambda i: chat("tok ", [i]))
    led = Ledger(kind, body)
    led.feed(make(0))
    read = [msgspec.json.encode(make(i)) for i in range(1, 101)]
    started = time.monotonic()
    for n in range(1, 2001):
        assert led.relay(read, []) == 100
        led.feed(make(7))  # and one event the slow way in each read
        if n % 100 == 0:  # the text read now and then, as a cut reads it
            assert len(led.text) == 4 * (1 + n * 101)
    assert time.monotonic() - started < 8.0
    assert len(led.generated) == 1 + 2000 * 101 and led.text == "tok " * (1 + 2000 * 101)


IMAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
                                     {"type": "text", "text": "what is it?"}]}


@pytest.mark.parametrize("body, mode", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "tokens"),
    ({"messages": [IMAGE], "temperature": 0}, "replay"),
    ({"messages": [IMAGE], "temperature": 0.7, "seed": 1}, "replay"),
    ({"messages": [IMAGE], "temperature": 0.7}, None),
    ({"messages": [IMAGE], "n": 2, "temperature": 0}, None),
])
def test_a_multimodal_chat_is_replayed_when_it_is_deterministic(body, mode):
    assert mode_of("chat", body) == mode


def test_a_replay_skips_what_the_client_has_and_checks_it():
    led = Ledger("chat", {"messages": [IMAGE], "temperature": 0, "stream": True, "kv_transfer_params": {"a": 1}},
                 mode="replay")
    led.feed(chat(None, [], role=True))
    led.feed(chat("ab", [4]))
    led.feed(chat("", [5]))
    led.cut("")
    again = led.continuation()
    assert again["messages"] == [IMAGE] and "kv_transfer_params" not in again and again["return_token_ids"]
    assert led.feed(chat(None, [], role=True)) == []
    assert led.feed(chat("a", [4])) == []
    out = led.feed(chat("bc", [5, 6]))  # the rest of a known token's text, and a new token
    assert out[0]["choices"][0]["delta"] == {"content": "c"} and out[0]["id"] == "chatcmpl-1"
    assert led.generated == [4, 5, 6] and led.text == "abc"
    led.cut("")
    with pytest.raises(BackendFailed) as diverged:
        led.feed(chat("ab", [4, 9]))
    assert diverged.value.reason == "diverged"
