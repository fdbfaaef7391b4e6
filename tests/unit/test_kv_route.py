"""The KV router's choice (router/kv_route.py) and the engine side's settings (engine/kv_events.py),
without a network: real pools, real indexes filled by hand, real block hashing."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from ascendserve.config import ConfigError, ProxyConfig, load
from ascendserve.engine import kv_events
from ascendserve.engine.middleware import CacheInfo as CacheInfoRoute
from ascendserve.protocol.kv_events import CacheInfo
from ascendserve.protocol.registry import Registration
from ascendserve.router.block_hash import BlockHasher
from ascendserve.router.kv_index import CacheIndex, KVEvents
from ascendserve.router.kv_route import KVRouter
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.pools import ACTIVE, Pools

BS = 16
INFO = CacheInfo(endpoints=["tcp://127.0.0.1:1"], replay=["tcp://127.0.0.1:2"], block_size=BS)


class NoUpstream:
    async def post_json(self, url, body, headers=None):
        raise AssertionError("the engine was asked although the ids were known")


def cluster(n: int = 2, **settings):
    pools = Pools()
    events = KVEvents()
    for i in range(n):
        url = f"http://127.0.0.1:{9000 + i}"
        inst = pools["pd"].add(url)
        pools["pd"].set_state(inst, ACTIVE)
        inst.cache = INFO
        idx = events.indexes[url] = CacheIndex(url, INFO)
        idx.known = True
    metrics = ProxyMetrics(pools)
    router = KVRouter(pools, NoUpstream(), events, ProxyConfig(**settings), metrics, random.Random(0))
    return pools, events, router, metrics


def hold(events, url: str, ids: list[int], blocks: int) -> None:
    events.indexes[url].blocks.update(BlockHasher("sha256", "vllm-none-hash").keys(ids, BS)[:blocks])


def plan(router, ids, kind="completions", **body):
    return asyncio.run(router.plan(kind, {"model": "m", "prompt": ids, **body}, "pd", {}))


IDS = list(range(1000, 1000 + 10 * BS))  # ten blocks


def test_the_instance_holding_the_prefix_wins_until_its_load_outweighs_it():
    pools, events, router, metrics = cluster()
    a, b = pools["pd"].active()
    hold(events, b.url, IDS, 8)
    p = plan(router, IDS)
    assert p.overlap == {a.url: 0, b.url: 8 * BS} and p.source == "ids"
    assert router.pick(p, pools["pd"], frozenset()) is b
    b.active_tokens = 7 * BS  # in flight: 7 blocks < the 8 it saves
    assert router.pick(p, pools["pd"], frozenset()) is b
    b.active_tokens = 9 * BS  # 9 > 8
    assert router.pick(p, pools["pd"], frozenset()) is a
    assert router.pick(p, pools["pd"], frozenset({a.url})) is b  # a retry elsewhere
    b.active_tokens = 0
    router.settings.kv_overlap_weight = 0.0  # load only: a tie, the least loaded (first) wins
    a.active_tokens = 1
    assert router.pick(p, pools["pd"], frozenset()) is b


def test_overlap_counts_from_the_first_block_only():
    pools, events, router, _ = cluster()
    a, b = pools["pd"].active()
    keys = BlockHasher("sha256", "vllm-none-hash").keys(IDS, BS)
    events.indexes[a.url].blocks.update(keys[1:])  # everything but the first block: no hit in vLLM
    events.indexes[b.url].blocks.update(keys[:2])
    p = plan(router, IDS)
    assert p.overlap == {a.url: 0, b.url: 2 * BS}


def test_by_load_when_an_index_is_unknown_or_the_request_carries_extra_keys():
    pools, events, router, metrics = cluster()
    a, b = pools["pd"].active()
    hold(events, b.url, IDS, 8)
    events.indexes[a.url].known = False
    assert plan(router, IDS) is None
    events.indexes[a.url].known = True
    assert plan(router, IDS, cache_salt="s") is None
    chat = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
    assert asyncio.run(router.plan("chat", chat, "pd", {})) is None
    b.cards = ({"id": "adapter", "parent": "m"},)
    assert asyncio.run(router.plan("completions", {"model": "adapter", "prompt": IDS}, "pd", {})) is None
    text = metrics.render().decode()
    for why in ("unknown", "unsupported"):
        assert f'ascendserve_proxy_kv_routing_total{{by="{why}",role="pd"}}' in text


def test_xxhash_instances_are_routed_by_load_and_a_lone_instance_is_not_planned():
    pools, events, router, _ = cluster()
    a, _ = pools["pd"].active()
    events.indexes[a.url].info = CacheInfo(endpoints=INFO.endpoints, hash_algo="xxhash", hash_seed=None)
    assert plan(router, IDS) is None
    pools1, _, router1, _ = cluster(1)
    assert plan(router1, IDS) is None


def test_prefix_match_unit_takes_every_kth_finer_hash():
    pools, events, router, _ = cluster()
    a, b = pools["pd"].active()
    fine = BlockHasher("sha256", "vllm-none-hash").keys(IDS, 8)
    for url in (a.url, b.url):
        events.indexes[url].info = CacheInfo(endpoints=INFO.endpoints, block_size=BS, hash_block_size=8)
    events.indexes[b.url].blocks.update(fine[1::2][:3])  # vLLM's 16-token blocks keep every second 8-token hash
    assert plan(router, IDS).overlap[b.url] == 3 * BS


def test_temperature_spreads_choices_by_softmax():
    pools, events, router, _ = cluster(kv_temperature=1.0)
    a, b = pools["pd"].active()
    hold(events, b.url, IDS, 2)
    p = plan(router, IDS)
    picks = [router.pick(p, pools["pd"], frozenset()).url for _ in range(400)]
    share = picks.count(b.url) / len(picks)
    assert 0.5 < share < 0.75, share  # exp(2 / 10) : 1 -> 0.55
    router.settings.kv_temperature = 0.0
    assert {router.pick(p, pools["pd"], frozenset()).url for _ in range(20)} == {b.url}


def test_local_ids_that_differ_from_the_engines_switch_the_model_to_the_engine():
    _, _, router, metrics = cluster()
    p = plan(router, IDS)
    p.source, p.model = "local", "m"
    router.check_ids(p, IDS)
    assert "m" not in router._engine_only
    router.check_ids(p, IDS[:-1])
    assert "m" in router._engine_only
    assert "ascendserve_proxy_kv_tokenizer_mismatches_total 1.0" in metrics.render().decode()


# ---- engine side ---------------------------------------------------------------------------
def engine_config(role: str, model_dir, **flags):
    return load(role, None, {"model__path": str(model_dir), **flags}, env={})


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_events_are_on_for_pd_and_prefill_on_loopback_with_derived_ports(model_dir):
    for role, on in (("pd", True), ("prefill", True), ("decode", False)):
        c = engine_config(role, model_dir, server__port="8000")
        assert c.kv_events.enabled is on
        assert (c.kv_events.port, c.kv_events.replay_port, c.kv_events.host) == (9500, 10500, "127.0.0.1")
        assert bool(kv_events.events_args(c, [])) is on
    c = engine_config("pd", model_dir, server__port="8000")
    args = kv_events.events_args(c, [])
    settings = msgspec.json.decode(args[args.index("--kv-events-config") + 1])
    assert settings["endpoint"] == "tcp://127.0.0.1:9500" and settings["replay_endpoint"] == "tcp://127.0.0.1:10500"
    assert settings["enable_kv_cache_events"] and settings["publisher"] == "zmq"
    assert "--enable-prompt-tokens-details" in args
    assert kv_events.events_env(c, [])[kv_events.BIND_ENV] == "127.0.0.1"
    assert kv_events.events_args(engine_config("pd", model_dir, kv_events__enabled="false"), []) == []
    assert kv_events.events_args(c, ["--no-enable-prefix-caching"]) == []


def test_cache_info_says_how_blocks_are_hashed(model_dir):
    c = engine_config("pd", model_dir, server__port="8000")
    info = kv_events.cache_info(c, [], environ={})
    assert (info.hash_algo, info.hash_seed, info.block_size, info.details_added) == \
        ("sha256", "vllm-none-hash", 0, True)
    info = kv_events.cache_info(c, ["--prefix-caching-hash-algo=sha256_cbor", "--block-size", "32",
                                    "--enable-prompt-tokens-details"], environ={"PYTHONHASHSEED": "0"})
    assert (info.hash_algo, info.hash_seed, info.block_size, info.details_added) == ("sha256_cbor", "0", 32, False)
    assert kv_events.cache_info(c, ["--prefix-caching-hash-algo", "xxhash"], environ={"PYTHONHASHSEED": "7"}) \
        .hash_seed is None  # an xxhash seed stays a secret
    dp = engine_config("pd", model_dir, server__port="8000", engine__data_parallel_size="2")
    info = kv_events.cache_info(dp, [], environ={})
    assert info.endpoints == ["tcp://127.0.0.1:9500", "tcp://127.0.0.1:9501"]
    assert info.replay == ["tcp://127.0.0.1:10500", "tcp://127.0.0.1:10501"]
    assert kv_events.NO_OFFSET_ENV not in kv_events.events_env(dp, [])
    # ranks of `launch` on consecutive server ports: their own ports, no offset by vLLM, no overlap
    ranks = [engine_config("pd", model_dir, server__port=str(8000 + r), engine__data_parallel_size="2",
                           engine__data_parallel_rank=str(r)) for r in range(2)]
    infos = [kv_events.cache_info(c, [], environ={}) for c in ranks]
    assert [i.endpoints for i in infos] == [["tcp://127.0.0.1:9500"], ["tcp://127.0.0.1:9501"]]
    assert [i.replay for i in infos] == [["tcp://127.0.0.1:10500"], ["tcp://127.0.0.1:10501"]]
    assert all(kv_events.events_env(c, [])[kv_events.NO_OFFSET_ENV] == "1" for c in ranks)
    reg = msgspec.convert({"instance_id": "i", "role": "pd", "url": "http://h:1", "model": "m",
                           **kv_events.registration(c, [])}, Registration)
    assert reg.check() is None and reg.cache.endpoints == ["tcp://127.0.0.1:9500"]
    bad = msgspec.convert({"instance_id": "i", "role": "pd", "url": "http://h:1", "model": "m",
                           "cache": {"endpoints": ["udp://x"]}}, Registration)
    assert "tcp://host:port" in bad.check()


def test_kv_events_config_is_ours_and_ipv6_is_refused(model_dir):
    from ascendserve.engine.vllm_server import passthrough_args

    c = engine_config("pd", model_dir, engine__vllm_args=["--kv-events-config={}"])
    with pytest.raises(ConfigError, match="kv_events"):
        passthrough_args(c)
    with pytest.raises(ConfigError, match="IPv4"):
        kv_events.events_args(engine_config("pd", model_dir, kv_events__host="::1"), [])


def test_the_engine_serves_its_cache_info():
    body = msgspec.json.encode(INFO).decode()
    sent = []

    async def app(scope, receive, send):
        sent.append("vllm")

    async def send(message):
        sent.append(message)

    route = CacheInfoRoute(app, body)
    asyncio.run(route({"type": "http", "path": "/cache_info", "method": "GET"}, None, send))
    assert sent[0]["status"] == 200 and msgspec.json.decode(sent[1]["body"], type=CacheInfo) == INFO
    sent.clear()
    asyncio.run(CacheInfoRoute(app, "")({"type": "http", "path": "/cache_info", "method": "GET"}, None, send))
    assert sent == ["vllm"]  # none set: vLLM's 404


def test_plain_chats_are_rendered_here_as_transformers_renders_them(text_model):
    """The tiny model's template, rendered by the proxy, tokenized without special tokens: the
    ids transformers (what vLLM calls) gives for the same chat."""
    from transformers import AutoTokenizer

    from ascendserve.router.chat_template import LocalChat

    chat = LocalChat.load(str(text_model))
    hf = AutoTokenizer.from_pretrained(str(text_model))
    msgs = [{"role": "system", "content": "You keep the lighthouse."}, {"role": "user", "content": "Tide?"},
            {"role": "assistant", "content": "High at six."}, {"role": "user", "content": "And low? ü"}]
    for gen in (True, False):
        expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert chat.render({"messages": msgs, "add_generation_prompt": gen}) == expected
    assert chat.render({"messages": msgs}) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for other in ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
                  {"messages": msgs, "tools": []}, {"messages": [{"role": "user", "content": "x", "name": "n"}]},
                  {"messages": msgs, "chat_template": "{{ 1 }}"}, {"messages": []}):
        assert chat.render(other) is None, other
    assert LocalChat.load(str(text_model.parent / "no-such-model")) is None


def test_a_chat_is_planned_with_local_ids(text_model):
    pools, events, router, metrics = cluster()
    for inst in pools["pd"].active():
        inst.root = str(text_model)
    msgs = [{"role": "user", "content": "x" * 40}]
    p = asyncio.run(router.plan("chat", {"model": "m", "messages": msgs}, "pd", {}))
    assert p.source == "local" and p.prompt_tokens > 40  # no request to an engine (NoUpstream)
    router.settings.kv_tokenizer = "engine"
    with pytest.raises(AssertionError, match="the engine was asked"):
        asyncio.run(router.plan("chat", {"model": "m", "messages": msgs}, "pd", {}))


def test_a_decode_plan_reuses_the_ids_of_the_prefill_plan():
    pools, events, router, _ = cluster()
    a, b = pools["pd"].active()
    hold(events, a.url, IDS, 3)
    p = asyncio.run(router.plan("chat", {"model": "m", "messages": []}, "pd", {}, known=(IDS, "local")))
    assert p.source == "local" and p.overlap[a.url] == 3 * BS  # no tokenization (NoUpstream), no local files


def test_equal_costs_go_where_the_load_balancer_would_and_short_prompts_by_load():
    """With nothing cached anywhere and idle instances, requests still spread (the pool's own
    rotation breaks the tie), and a prompt shorter than a block is not planned."""
    pools, events, router, _ = cluster()
    a, b = pools["pd"].active()
    for idx in events.indexes.values():
        idx.block_size = BS
    chosen = []
    for _ in range(4):
        p = plan(router, IDS)
        inst = router.pick(p, pools["pd"], frozenset())
        pools["pd"].lease(inst, 10).release()  # served and done: the heap rotates
        chosen.append(inst.url)
    assert set(chosen) == {a.url, b.url}, chosen
    assert plan(router, IDS[:BS - 1]) is None
