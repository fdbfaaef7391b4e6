"""`kv_transfer_params`: the JSON fields vLLM / vllm-ascend's connectors exchange.

Pull (vllm-ascend MooncakeConnectorV1 and ours): the proxy sends P
`pull_prefill_params()`; P answers with `PullDecodeParams` fields, which the
proxy hands to D verbatim (unknown extra fields included).

Named (vLLM's MooncakeConnector): the proxy mints a transfer id; P gets
`named_prefill_params()`, D `named_decode_params()` with P's engine id and
bootstrap server; P answers with no params.

Push (vllm-ascend's layerwise connector): the proxy sends D
`push_decode_params()`; D reserves blocks and POSTs a `PushPrefillRequest`
to the metaserver, which dispatches P once with those params.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec


def pull_prefill_params() -> dict:
    """What P gets in pull mode (the null remote_* keys match vllm-ascend's proxy)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def named_prefill_params(transfer_id: str) -> dict:
    """What P gets in the named flow (vLLM's MooncakeConnector): the proxy names the transfer."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def named_decode_params(transfer_id: str, engine_id: str, bootstrap_addr: str) -> dict:
    """What D gets in the named flow: the transfer P was told of, P's engine id and the
    URL of P's bootstrap server (http://host:port), where D finds P's workers."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap_addr}


def push_decode_params(metaserver_url: str) -> dict:
    """What D gets in push mode: where to ask for its prefill."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": metaserver_url}


class PullDecodeParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """P's answer in pull mode; D needs the remote_* fields to fetch the blocks."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_block_ids: list[Any] | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_ptp_size: int | None = None
    remote_pcp_size: int | None = None
    remote_dcp_size: int | None = None
    remote_block_size: int | None = None
    num_prompt_blocks: int | None = None
    last_token_id: int | None = None


class PushPrefillRequest(msgspec.Struct, kw_only=True, omit_defaults=False):
    """D -> metaserver body of vllm-ascend's layerwise connector.

    `request_id` is the engine request id: "chatcmpl-<x-request-id>" for chat,
    "cmpl-<x-request-id>-<i>" for the i-th prompt of a completion."""

    request_id: str
    token_ids: list[int] = []
    do_remote_prefill: bool = False
    do_remote_decode: bool = True
    remote_block_ids: Any = None
    remote_block_size: Any = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_tp_size: int | None = None
    remote_pcp_size: int | None = None
    remote_dcp_size: int | None = None
    remote_cached_tokens: int | None = None


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "0:0:0:0:0:0:0:0", "[::]", ""})


def engine_request_ids(kind: str, request_id: str, body: dict) -> list[str]:
    """The ids vLLM gives the request(s) a proxy sends with x-request-id."""
    if kind == "chat":
        return [f"chatcmpl-{request_id}"]
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return [f"cmpl-{request_id}-{i}" for i in range(len(prompt) if many else 1)]


_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(engine_request_id: str) -> str:
    """vLLM (>= 0.11) appends '-<8 hex>' to the engine request id it derives from
    x-request-id; the proxy and the metaserver know only the id without it."""
    return _ENGINE_SUFFIX.sub("", engine_request_id)
