"""The kv_transfer_params of each connector's flow (protocol/kv_params.py, router/kv_flow.py)
against the field names in the engines' own code. vLLM's are read from the source of the vLLM
installed here (v0.32.0, the pin of scripts/install.sh), so an upgrade that renames one fails
here; vllm-ascend's are copied in tests/kv_wire.py with the commit and line they come from.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import msgspec

from ascendserve.protocol import kv_connectors as kc
from ascendserve.protocol import kv_params
from ascendserve.router import kv_flow
from ascendserve.router.pools import Instance
from tests import kv_wire

VLLM_KV = Path(importlib.util.find_spec("vllm").origin).parent / "distributed/kv_transfer/kv_connector/v1"


def _method(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    """The method `name` of class `cls` (the first of that name in the file without `cls`)."""
    tree = ast.parse(path.read_text())
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls] if cls else [tree]
    found = [n for scope in scopes for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls or ''}.{name} not found in {path}"
    return found[0]


def _returned_dict_keys(fn: ast.FunctionDef) -> tuple[str, ...]:
    """The keywords of the dict(...) in `return x, dict(...)`."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            call = node.value.elts[-1]
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "dict":
                return tuple(k.arg for k in call.keywords)
    raise AssertionError(f"no `return ..., dict(...)` in {fn.name}")


def _subscripted(fn: ast.FunctionDef, name: str) -> set[str]:
    """The string keys of `name[...]` in fn: the fields it reads without a default."""
    return {n.slice.value for n in ast.walk(fn) if isinstance(n, ast.Subscript) and getattr(n.value, "id", "") == name
            and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)}


def test_nixl_p_answers_what_the_stub_and_the_proxy_expect():
    fn = _method(VLLM_KV / "nixl/pull_scheduler.py", "request_finished")
    assert _returned_dict_keys(fn) == kv_wire.NIXL_P_REPLY


def test_nixl_d_needs_nothing_p_does_not_send():
    fn = _method(VLLM_KV / "nixl/metadata.py", "add_new_req_to_recv")  # D's read of P's params
    assert _subscripted(fn, "kv_transfer_params") <= set(kv_wire.NIXL_P_REPLY)


def test_pull_flow_asks_p_as_vllm_and_vllm_ascend_proxies_do():
    assert kv_params.pull_prefill_params() == kv_wire.ASCEND_PROXY_PREFILL_PARAMS
    # NIXL's P holds its blocks for D when do_remote_decode is set (request_finished: is_p_node)
    assert "do_remote_decode" in ast.unparse(_method(VLLM_KV / "nixl/pull_scheduler.py", "request_finished"))


def test_pull_flow_hands_p_answer_to_d_verbatim():
    pair = kv_flow.Pair("nixl", "pull", "lease")
    answer = {"kv_transfer_params": kv_wire.p_reply("nixl", "r1", 5600)}
    assert kv_flow.decode_params(pair, Instance(url="http://p", role="prefill"), answer, "r1") == \
        answer["kv_transfer_params"]


def test_named_flow_gives_vllm_mooncake_d_what_it_needs():
    fn = _method(VLLM_KV / "mooncake/mooncake_connector.py", "update_state_after_alloc", "MooncakeConnectorScheduler")
    needed = next(tuple(e.value for e in n.elts) for n in ast.walk(fn)
                  if isinstance(n, ast.Tuple) and all(isinstance(e, ast.Constant) for e in n.elts) and len(n.elts) == 3)
    assert needed == kv_wire.VLLM_MOONCAKE_D_NEEDS
    p = Instance(url="http://p", role="prefill")
    p.kv = kc.KVInfo(connector="mooncake", flow="named", free="ttl", engine_id="eng-p", host="10.0.0.1", port=8998)
    pair = kv_flow.Pair("mooncake", "named", "ttl")
    d = kv_flow.decode_params(pair, p, {}, "r1")
    assert set(needed) <= set(d) and d["do_remote_prefill"] is True
    assert d["remote_engine_id"] == "eng-p" and d["remote_bootstrap_addr"] == "http://10.0.0.1:8998"
    p_body = kv_flow.prefill_body(pair, {"prompt": "x", "max_tokens": 9, "stream": True}, "r1")
    assert p_body["kv_transfer_params"]["transfer_id"] == d["transfer_id"]  # P's finished request carries it
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True and p_body["max_tokens"] == 1
    # vLLM's P keeps the blocks only for a request with a transfer_id and do_remote_decode
    assert "transfer_id" in ast.unparse(_method(VLLM_KV / "mooncake/mooncake_connector.py", "request_finished",
                                                "MooncakeConnectorScheduler"))


def test_ascend_mooncake_d_needs_nothing_its_p_does_not_send():
    assert set(kv_wire.ASCEND_MOONCAKE_D_REQUIRED) <= set(kv_wire.ASCEND_MOONCAKE_P_REPLY)
    # ours speaks the same: P answers PullDecodeParams, which carries every field D requires
    assert set(kv_wire.ASCEND_MOONCAKE_D_REQUIRED) <= set(kv_params.PullDecodeParams.__struct_fields__)


def test_push_flow_is_vllm_ascend_layerwise():
    assert tuple(kv_params.push_decode_params("http://m/v1/metaserver")) == kv_wire.ASCEND_LAYERWISE_DECODE_PARAMS
    assert set(kv_params.PushPrefillRequest.__struct_fields__) == set(kv_wire.ASCEND_LAYERWISE_METASERVER_BODY)
    body = dict.fromkeys(kv_wire.ASCEND_LAYERWISE_METASERVER_BODY, None) | {
        "request_id": "cmpl-x-0", "token_ids": [], "do_remote_prefill": False, "do_remote_decode": True}
    assert msgspec.convert(body, kv_params.PushPrefillRequest).request_id == "cmpl-x-0"


def test_store_flow_sends_no_params():
    pair = kv_flow.Pair("lmcache", "store", "none")
    assert "kv_transfer_params" not in kv_flow.prefill_body(pair, {"prompt": "x", "max_tokens": 5}, "r")
    assert kv_flow.decode_params(pair, Instance(url="http://p", role="prefill"), {"kv_transfer_params": {"a": 1}},
                                 "r") is None


def test_every_connector_vllm_ships_is_named_as_its_factory_registers_it():
    """The classes the table names for vLLM's own connectors are registered by vLLM's factory
    (vllm-ascend's by its plugin, kv_wire cites where: vllm_ascend/distributed/kv_transfer/__init__.py)."""
    factory = (VLLM_KV.parent / "factory.py").read_text()
    for name, spec in kc.CONNECTORS.items():
        if spec.package in ("vllm", "nixl", "mooncake", "lmcache") and spec.module_path is None:
            assert f'"{spec.vllm_class}"' in factory, f"{name}: vLLM registers no {spec.vllm_class}"
