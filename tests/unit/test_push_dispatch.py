"""The metaserver's push rendezvous, with the HTTP call to P recorded in memory."""

import asyncio

import pytest

from ascendserve.metaserver.push import PushDispatcher, PushError
from ascendserve.protocol.kv_params import PushPrefillRequest


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def d_request(request_id, host="10.0.0.2"):
    return PushPrefillRequest(request_id=request_id, remote_block_ids=[[1]], remote_engine_id="d",
                              remote_host=host, remote_port=7000, remote_cached_tokens=0)


def make(fail=0, delay=0.0):
    calls = []

    async def post_json(url, body, headers):
        calls.append((url, body, headers))
        await asyncio.sleep(delay)
        if len(calls) <= fail:
            raise PushError(502, "P down")
        return {"ok": True}

    clock = FakeClock()
    return PushDispatcher(post_json, ttl_s=60, clock=clock), calls, clock


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 50,
        "stream_options": {"include_usage": True}}


def test_dispatches_p_once_with_ds_params():
    async def go():
        push, calls, _ = make(delay=0.05)
        ticket = push.expect("r1", ["chatcmpl-r1"], "/v1/chat/completions", BODY, "http://p:1/")
        results = await asyncio.gather(*(push.ask(ticket, d_request("chatcmpl-r1")) for _ in range(3)))
        assert results == [{"status": "ok"}] * 3
        assert len(calls) == 1
        url, body, headers = calls[0]
        assert url == "http://p:1/v1/chat/completions" and headers == {"x-request-id": "r1"}
        assert body["max_tokens"] == 1 and body["min_tokens"] == 1 and body["stream"] is False
        assert "stream_options" not in body and BODY["max_tokens"] == 50
        assert body["kv_transfer_params"]["remote_host"] == "10.0.0.2"
        assert body["kv_transfer_params"]["do_remote_decode"] is True
    asyncio.run(go())


def test_multi_prompt_waits_for_every_child_then_batches():
    async def go():
        push, calls, _ = make()
        ids = ["cmpl-r2-0", "cmpl-r2-1"]
        ticket = push.expect("r2", ids, "/v1/completions", {"model": "m", "prompt": ["a", "b"]}, "http://p:1")
        first = asyncio.ensure_future(push.ask(ticket, d_request(ids[0])))
        await asyncio.sleep(0.05)
        assert not first.done() and calls == []
        await push.ask(ticket, d_request(ids[1]))
        assert await first == {"status": "ok"} and len(calls) == 1
        assert set(calls[0][1]["kv_transfer_params"]["batch_kv_transfer_params"]) == set(ids)
    asyncio.run(go())


def test_refusals():
    async def go():
        push, calls, clock = make()
        ticket = push.expect("r3", ["chatcmpl-r3"], "/v1/chat/completions", BODY, "http://p:1")
        with pytest.raises(PushError) as e:
            await push.ask("wrong", d_request("chatcmpl-r3"))
        assert e.value.status == 403
        with pytest.raises(PushError) as e:
            await push.ask(ticket, d_request("chatcmpl-other"))
        assert e.value.status == 404
        with pytest.raises(PushError) as e:
            await push.ask(ticket, d_request("chatcmpl-r3", host="0.0.0.0"))
        assert e.value.status == 400
        clock.t = 61
        with pytest.raises(PushError) as e:
            await push.ask(ticket, d_request("chatcmpl-r3"))
        assert e.value.status == 404
        assert push.expire() == 1 and push.pending() == 0 and calls == []
    asyncio.run(go())


def test_failed_prefill_is_502_and_can_be_retried():
    async def go():
        push, calls, _ = make(fail=1)
        ticket = push.expect("r4", ["chatcmpl-r4"], "/v1/chat/completions", BODY, "http://p:1")
        with pytest.raises(PushError) as e:
            await push.ask(ticket, d_request("chatcmpl-r4"))
        assert e.value.status == 502
        assert await push.ask(ticket, d_request("chatcmpl-r4")) == {"status": "ok"}
        assert len(calls) == 2
    asyncio.run(go())
