"""Which P and D a disaggregated request may pair, and what each hop carries, by the KV
connector they run (protocol/kv_connectors.py has the table of connectors and flows).

An instance says which connector it runs at GET /kv_info or in its registration
(`Instance.kv`); one that does not (a plain vLLM) pairs with any. P and D of different
connectors are never paired: with no pair possible the request gets a 503 naming what
each side runs, and the proxy logs it once per change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from ascendserve.protocol import kv_params
from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.protocol.openai import APIError
from ascendserve.router.pools import Instance

log = structlog.get_logger("ascendserve.router")


@dataclass(frozen=True)
class Pair:
    """One request's KV connector ("" where no instance said), its flow and how P's blocks
    are freed when D fails, and the instances of each side that run another connector."""

    connector: str
    flow: str
    free: str
    p_out: frozenset[str] = frozenset()
    d_out: frozenset[str] = frozenset()


class Pairing:
    def __init__(self, default_flow: str):
        self.default_flow = default_flow  # [proxy] mode: for P and D that say nothing
        self._warned: tuple | None = None
        self.quiet = False  # another proxy worker says it (router/workers.py: the leader checks())

    def pair(self, prefill: list[Instance], decode: list[Instance],
             pick: Callable[[frozenset[str]], Instance | None]) -> Pair:
        """The pair for a request over the active P and D, by the connector of the P that
        `pick` (the prefill pool's choice, skipping the given URLs) takes among those that can
        pair. APIError 503 when none can."""
        d_connectors = {i.kv_connector for i in decode}
        usable = [i for i in prefill if "" in d_connectors or not i.kv_connector or i.kv_connector in d_connectors]
        if not usable:
            p_side, d_side = sorted({i.kv_connector for i in prefill}), sorted(d_connectors)
            if self._warned != (p_side, d_side) and not self.quiet:
                self._warned = (p_side, d_side)
                log.warning("KV connectors of prefill and decode differ: not pairing them", prefill=p_side,
                            decode=d_side, prefill_urls=[i.url for i in prefill], decode_urls=[i.url for i in decode])
            raise APIError(503, f"no prefill and decode instances share a KV connector: prefill runs "
                           f"{', '.join(p_side)}, decode runs {', '.join(d_side)}; start both with the same "
                           "--kv-connector", type="service_unavailable", code="kv_connector_mismatch")
        self._warned = None
        p = pick(frozenset(i.url for i in prefill) - {i.url for i in usable}) or usable[0]
        info = p.kv or next((i.kv for i in decode if i.kv is not None), None)
        if info is None:
            return Pair("", self.default_flow, "none")  # never speak to a side channel we do not know
        return Pair(info.connector, info.flow, info.free,
                    frozenset(i.url for i in prefill if i.kv_connector not in ("", info.connector)),
                    frozenset(i.url for i in decode if i.kv_connector not in ("", info.connector)))


    def check(self, prefill: list[Instance], decode: list[Instance]) -> None:
        """Log a mismatch of the active P and D now (once), not at the next request."""
        if prefill and decode:
            try:
                self.pair(prefill, decode, lambda _: None)
            except APIError:
                pass


def prefill_body(pair: Pair, body: dict, request_id: str) -> dict:
    """What P gets in the pull, named and store flows: the client's request cut to one
    token, with the flow's kv_transfer_params (none for store)."""
    p_body = dict(body, max_tokens=1, min_tokens=1, stream=False)
    p_body.pop("stream_options", None)
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    if pair.flow == "pull":
        p_body["kv_transfer_params"] = kv_params.pull_prefill_params()
    elif pair.flow == "named":
        p_body["kv_transfer_params"] = kv_params.named_prefill_params(transfer_id(request_id))
    return p_body


def decode_params(pair: Pair, p_inst: Instance, p_reply: dict, request_id: str) -> dict | None:
    """D's kv_transfer_params after P answered: P's own (pull), the transfer P was told of
    and where P is (named), none (store)."""
    if pair.flow == "pull":
        params = p_reply.get("kv_transfer_params")
        return params if isinstance(params, dict) and params else None
    if pair.flow == "named":
        info: KVInfo | None = p_inst.kv
        if info is None or not info.engine_id or not info.port:
            raise APIError(503, f"prefill {p_inst.url} did not say its engine id and bootstrap port (/kv_info)",
                           type="service_unavailable", code="kv_connector_unknown")
        return kv_params.named_decode_params(transfer_id(request_id), info.engine_id,
                                             f"http://{info.host}:{info.port}")
    return None


def transfer_id(request_id: str) -> str:
    return f"xfer-{request_id}"
