"""Every KV connector an engine role can run, and how the proxy drives each: one table.

`[kv] connector` names a row (or is `module.path:ClassName`, a connector of the
user's own, or `multi`, several rows at once). A row says which vLLM connector
class it is and its *flow*: the order of the proxy's hops and what each carries
in `kv_transfer_params` (the builders are in protocol/kv_params.py):

    pull   P first, with the client's request, max_tokens=1 and
           `pull_prefill_params()`; P answers with where its blocks are
           (`kv_transfer_params`), which the proxy hands to D verbatim with the
           client's request. D reads the blocks from P. vLLM's NixlConnector,
           vllm-ascend's MooncakeConnectorV1, ours.
    named  P first, max_tokens=1 and `named_prefill_params(transfer_id)`: the
           proxy names the transfer. P answers with nothing; D gets
           `named_decode_params(...)`: the same transfer id, P's engine id and
           P's bootstrap server (from P's /kv_info or registration). vLLM's
           MooncakeConnector.
    push   D first: D gets `push_decode_params(metaserver)`, reserves blocks and
           asks the metaserver, which dispatches P once; P writes into D.
           vllm-ascend's MooncakeLayerwiseConnector, ours.
    store  P first with max_tokens=1 and no kv_transfer_params: P saves the
           prompt's KV into a pool; then D gets the client's request as it is and
           loads the prefix from the pool. LMCache, vllm-ascend's KV pool.

`free` says what happens to P's blocks when D fails or the client goes away
before D read them:
    side-channel  the proxy tells P at once (ours: FREE on P's side channel)
    lease         P frees them when D's lease lapses (NixlConnector's
                  kv_lease_duration, which the role sets from `[kv] ttl_s`)
    ttl           P frees them a fixed time after the prefill (the role sets the
                  connector's timeout from `[kv] ttl_s` where it has one)
    none          nothing is held for D (a pool keeps the KV on its own terms)
The proxy never speaks to another connector's side channel.

The registry and the engines' `/kv_info` route carry an instance's connector
name; the proxy pairs P and D only when the names are equal (an instance that
does not say, e.g. a plain vLLM, pairs with any). The field names these flows
exchange are pinned by tests/unit/test_kv_connectors_wire.py against vLLM's and
vllm-ascend's own code.

No torch and no vLLM here: the proxy imports this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

FLOWS = ("pull", "named", "push", "store")
CUSTOM = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # module.path:ClassName
MULTI = "multi"


@dataclass(frozen=True)
class ConnectorSpec:
    name: str
    vllm_class: str  # kv_connector: a name vLLM's KVConnectorFactory (or vllm-ascend's plugin) registers
    module_path: str | None  # kv_connector_module_path; None: the factory knows the class
    flow: str
    free: str
    moves: str  # what moves the bytes (README's table)
    tested: str  # where it is tested (README's table)
    package: str = "vllm"  # the Python package it needs on the engine's host
    multi_ok: bool = True  # may be a child of `multi`
    roles: tuple[str, str] = ("kv_producer", "kv_consumer")  # vLLM kv_role of P, of D


CONNECTORS: dict[str, ConnectorSpec] = {c.name: c for c in (
    ConnectorSpec("example", "ExampleConnector", None, "pull", "none",
                  "files in a shared directory ([kv] path); a demo", "1P1D on CPU (real engines)"),
    ConnectorSpec("pull", "AscendPullConnector", "ascendserve.connectors.kv.pull", "pull", "side-channel",
                  "ascendserve: D reads P's pages over tcp, shm or Mooncake TE",
                  "1P1D, TP, MLA, MoE on CPU (real engines)", package="ascendserve"),
    ConnectorSpec("push", "AscendPushConnector", "ascendserve.connectors.kv.push", "push", "ttl",
                  "ascendserve: P writes each layer's pages into D over tcp",
                  "1P1D on CPU (real engines)", package="ascendserve", multi_ok=False),
    ConnectorSpec("nixl", "NixlConnector", None, "pull", "lease",
                  "NIXL (UCX: RDMA, NVLink, TCP): D reads P's blocks",
                  "1P1D on CPU over UCX tcp (real engines)", package="nixl"),
    ConnectorSpec("mooncake", "MooncakeConnector", None, "named", "ttl",
                  "vLLM's Mooncake TE connector (RDMA): D reads P's blocks",
                  "arguments and proxy flow (stub engines)", package="mooncake"),
    ConnectorSpec("ascend-mooncake", "MooncakeConnectorV1", None, "pull", "ttl",
                  "vllm-ascend: Mooncake TE over HCCS/RoCE, D reads P's blocks",
                  "arguments and proxy flow (stub engines)", package="vllm_ascend"),
    ConnectorSpec("ascend-layerwise", "MooncakeLayerwiseConnector", None, "push", "ttl",
                  "vllm-ascend: Mooncake TE, P writes each layer into D",
                  "arguments and proxy flow (stub engines)", package="vllm_ascend", multi_ok=False),
    ConnectorSpec("ascend-store", "AscendStoreConnector", None, "store", "none",
                  "vllm-ascend's KV pool (Mooncake store, memcache)",
                  "arguments and proxy flow (stub engines)", package="vllm_ascend"),
    ConnectorSpec("lmcache", "LMCacheConnectorV1", None, "store", "none",
                  "LMCache (its own config file, LMCACHE_CONFIG_FILE)",
                  "arguments and proxy flow (stub engines)", package="lmcache"),
)}
NAMES = (*CONNECTORS, MULTI)
OURS = ("pull", "push")  # configured by [kv]'s own settings, not by [kv.extra]


class KVInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What a P or D says of its KV connector: GET /kv_info on the engine, and its
    registration. `host`/`port`: its side channel (ours, nixl) or bootstrap server
    (vLLM's mooncake); `engine_id`: vLLM's kv_transfer_config engine_id."""

    connector: str
    connectors: list[str] = []
    flow: str = "pull"
    free: str = "none"
    engine_id: str = ""
    host: str = ""
    port: int = 0

    def check(self) -> str | None:
        if self.flow not in FLOWS:
            return f"kv flow must be one of {', '.join(FLOWS)}, got {self.flow!r}"
        if not 0 <= self.port <= 65535:
            return f"kv port out of range: {self.port}"
        return None


def members(name: str, children: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The connectors a setting runs: `multi`'s children, else the one named."""
    return list(children) if name == MULTI else [name]


def setting_why_not(name: str, children: list[str] | tuple[str, ...], has_extra: bool,
                    data_parallel_size: int = 1) -> str | None:
    """Why a `[kv]` setting cannot work anywhere (None: it can), naming it: an unknown name,
    `multi` of fewer than two, of a push connector, of one twice or of two that each move KV
    from P to D, kv.connectors without multi, [kv.extra] for ours, vLLM's mooncake with DP."""
    allowed = ", ".join(n for n, c in CONNECTORS.items() if c.multi_ok)
    if name not in NAMES and not CUSTOM.match(name):
        return (f"kv.connector = {name!r}: want one of {', '.join(NAMES)}, or module.path:ClassName "
                "(a connector of your own, with a [kv.extra] table)")
    if name != MULTI and children:
        return f"kv.connectors is for kv.connector = 'multi', not {name!r}"
    if name == MULTI and len(children) < 2:
        return f"kv.connector = 'multi' needs kv.connectors, two or more of {allowed} (--kv-connectors a b)"
    for child in children:
        spec = CONNECTORS.get(child)
        if spec is None or not spec.multi_ok:
            return (f"kv.connectors: {child!r} cannot be a connector of 'multi' (allowed: {allowed}; push "
                    "connectors write into D while the proxy waits on D, so no other connector can share the request)")
    if len(set(children)) != len(children):
        return f"kv.connectors lists a connector twice: {list(children)}"
    moving = [c for c in children if CONNECTORS[c].flow != "store"]
    if len(moving) > 1:
        return (f"kv.connectors: {', '.join(moving)} each move KV from P to D and P answers with one set of "
                "kv_transfer_params; 'multi' takes one of them plus KV pools (ascend-store, lmcache)")
    if has_extra and name in ("example", *OURS):
        return (f"[kv.extra] is for the engines' connectors; kv.connector = {name!r} is configured by the "
                "[kv] settings themselves")
    if "mooncake" in members(name, children) and data_parallel_size > 1:
        return ("kv.connector 'mooncake' (vLLM's MooncakeConnector) takes one engine per instance: P answers "
                "with no kv_transfer_params, so the proxy could not tell D which data-parallel rank holds the "
                "blocks; run the ranks as instances of their own (data_parallel_size = 1)")
    return None


def flow_of(name: str, children: list[str] | tuple[str, ...] = (), custom_flow: str = "pull") -> str:
    """The proxy's flow for a connector: `multi`, that of its child that moves KV from P
    to D (vLLM's MultiConnector answers with the first child's kv_transfer_params), else
    store; a connector of the user's own, `custom_flow` ([kv] flow)."""
    if name == MULTI:
        flows = [CONNECTORS[c].flow for c in children if c in CONNECTORS]
        return next((f for f in flows if f != "store"), "store")
    if name in CONNECTORS:
        return CONNECTORS[name].flow
    return custom_flow


def free_of(name: str, children: list[str] | tuple[str, ...] = ()) -> str:
    """How P's blocks are freed when D never reads them (the table's `free`)."""
    if name == MULTI:
        frees = [CONNECTORS[c].free for c in children if c in CONNECTORS and CONNECTORS[c].flow != "store"]
        return frees[0] if frees else "none"
    return CONNECTORS[name].free if name in CONNECTORS else "ttl"


def compatible(p_connector: str, d_connector: str) -> bool:
    """Whether P and D may be paired: the same connector, or one of them does not say."""
    return not p_connector or not d_connector or p_connector == d_connector
