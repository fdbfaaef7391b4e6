"""The proxy relays a backend's stream in whole SSE events (router/sse.SSEFramer)."""

from __future__ import annotations

import random

from ascendserve.router.sse import SSEFramer

EVENTS = [b'data: {"choices": [{"text": "a\\u2028b"}]}\n\n', b'data: {"choices": [{"text": "c"}]}\n\n',
          b"data: [DONE]\n\n"]


def test_any_split_of_a_stream_comes_out_as_whole_events_and_loses_nothing():
    stream = b"".join(EVENTS)
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        framer, out = SSEFramer(), []
        for chunk in chunks:
            if whole := framer.feed(chunk):
                assert whole.endswith(b"\n\n"), whole  # never half an event
                out.append(whole)
        out.append(framer.flush())
        assert b"".join(out) == stream


def test_a_backend_dying_mid_event_leaves_only_whole_events_sent():
    framer = SSEFramer()
    sent = framer.feed(EVENTS[0] + EVENTS[1][:10])
    assert sent == EVENTS[0]
    assert framer.held == EVENTS[1][:10]  # dropped, not sent, when the stream breaks here


def test_an_event_without_an_end_is_held_only_up_to_the_bound():
    framer = SSEFramer(max_held=64)
    assert framer.feed(b"x" * 40) == b""
    assert framer.feed(b"y" * 40) == b"x" * 40 + b"y" * 40  # past the bound: passed on as it comes
    assert framer.held == b""
