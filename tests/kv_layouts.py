"""KV caches laid out by vLLM's own code (`create_kv_cache_views` over one backing buffer, as
vLLM 0.32's `allocate_kv_cache` does) in every `KVCacheLayout`, and a producer process that
serves them over the KV side channel (`python -m tests.kv_layouts CASES`).

A case is (name, layout, spec kind, heads per rank, P's TP size, kernel block size or None,
padded or not). The test process lays the views out with vLLM and hands the producer their
description (`describe`: offset, shape and strides of each layer over a buffer of random
bytes from a seed); the producer rebuilds the very same views from it (`rebuild`) with torch
alone, so it does not spend seconds importing vLLM.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from ascendserve import ops_cuda

NUM_BLOCKS = 12
LAYERS = 11  # more than 10: name order (layers.10 before layers.2) differs from memory order
BLOCK = 16
HEAD = 32
HELD = [[3, 4, 5, 11], [0, 7, 7, 2], [9], [1, 2, 3, 4, 5, 6, 8, 10]]  # request i holds HELD[i]
# staged pages' pool (kv/staging.py): a layer of a long read is several units (an 8 KiB page,
# 4 to a unit; an MLA page alone), and a cross-layer block (88 KiB) is larger than the budget
STAGING_BUDGET = 64 << 10
# P's staged pages are gathered by the CUDA kernels' code (emulated on the CPU) when it is
# built, D's staged pages scattered by torch's index ops: both copy codes of the device path
PRODUCER_KERNELS = "emulated" if ops_cuda.cuda_library_built() else "torch"


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    kind: str = "attention"  # or "mla"
    heads: int = 4  # KV heads per P rank
    p_tp: int = 1
    kernel_block: int | None = None
    padded: bool = False

    def to_json(self) -> dict:
        return self.__dict__.copy()


def spec_of(case: Case, heads: int | None = None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if case.kind == "mla":  # one latent per token: kv_lora_rank 512 + rope 64, no heads
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads or case.heads, head_size=HEAD,
                             dtype=torch.float16)
    if case.padded:
        from dataclasses import replace

        spec = replace(spec, page_size_padded=spec.page_size_bytes + 192)
    return spec


def build(case: Case, seed: int, heads: int | None = None) -> dict[str, torch.Tensor]:
    """Per-layer views of one random backing buffer, as vLLM would hand them to a connector."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[case.layout]
    spec = spec_of(case, heads)
    padded = getattr(spec, "page_size_padded", None)
    block_stride = padded if padded and not layout.is_block_outermost else None
    layer_stride, block_stride, _, _, _ = compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout, fixed_strides=(None, block_stride, None, None, None))
    if layout.is_block_outermost:
        size = block_stride * NUM_BLOCKS
    else:
        size = layer_stride * LAYERS
    raw = _raw(size, seed)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=case.kernel_block)
    return dict(zip(names, views))


def _raw(size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g)


def describe(views: dict[str, torch.Tensor]) -> dict:
    """What `rebuild` needs to make the same views over the same random bytes."""
    first = next(iter(views.values()))
    return {"size": first.untyped_storage().nbytes(), "dtype": str(first.dtype).removeprefix("torch."),
            "layers": {name: [v.storage_offset(), list(v.shape), list(v.stride())] for name, v in views.items()}}


def rebuild(desc: dict, seed: int) -> dict[str, torch.Tensor]:
    storage = _raw(desc["size"], seed).untyped_storage()
    dtype = getattr(torch, desc["dtype"])
    return {name: torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            for name, (offset, shape, stride) in desc["layers"].items()}


def pages_of(views: dict[str, torch.Tensor], block: int, kernel_ratio: int = 1) -> list[torch.Tensor]:
    """Each layer's logical page of manager block `block`: [K, H, N, C] as raw bytes."""
    out = []
    for name in sorted(views):
        v = views[name]
        v = v.unflatten(0, (-1, kernel_ratio))[block] if kernel_ratio > 1 else v[block][None]
        out.append(v.contiguous().view(torch.uint8))
    return out


def producer_seed(case: Case, rank: int) -> int:
    return 1000 + 17 * rank + sum(map(ord, case.name))


def producer_args(cases: list[Case], transports: list[str]) -> list[str]:
    """The producer's command-line arguments: each case's P ranks, described."""
    ranks = {c.name: [describe(build(c, producer_seed(c, r))) for r in range(c.p_tp)] for c in cases}
    return [json.dumps([{**c.to_json(), "ranks": ranks[c.name]} for c in cases]), json.dumps(transports)]


class _Held:
    """The producer's holds: request `<case>-<transport>-<i>` holds HELD[i] until the run ends."""

    def __init__(self, names: list[str]):
        self.held = {name: set(blocks) for name in names for blocks in [HELD[int(name.rsplit("-", 1)[1])]]}

    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        if not set(block_ids) <= self.held[request_id]:
            raise ValueError(f"{request_id} does not hold {block_ids}")

    def release(self, request_id: str) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        return False


def main(argv: list[str]) -> None:
    """Serve every case's caches (one side-channel server per P rank, tcp and shm, torch and
    our transport code only), once read in place and once staged, holding HELD for requests
    `<case>-<transport>-<i>`; print {"<case>/host" or "<case>/staged": base port} and run
    until stdin closes."""
    from ascendserve.connectors.kv.pages import PagedKV
    from ascendserve.connectors.transport import make_transport
    from ascendserve.connectors.transport.channel import ChannelServer
    from tests.ports import free_port_run

    transports = json.loads(argv[1])
    servers, ports = [], {}
    for spec in json.loads(argv[0]):
        ranks = spec.pop("ranks")
        case = Case(**spec)
        holds = _Held([f"{case.name}-{t}-{i}" for t in transports for i in range(len(HELD))])
        for staged in (False, True):  # host views, and the device path (staging) on the same memory
            base = free_port_run(case.p_tp, derived=False)
            for rank, desc in enumerate(ranks):
                pages = PagedKV(rebuild(desc, producer_seed(case, rank)), NUM_BLOCKS, staging=staged,
                                staging_budget=STAGING_BUDGET, kernels=PRODUCER_KERNELS if staged else "auto")
                server = ChannelServer("127.0.0.1", base + rank, holds, pages, "tok",
                                       {name: make_transport(name, pages) for name in ("tcp", "shm")})
                server.start()
                servers.append(server)
            ports[f"{case.name}/{'staged' if staged else 'host'}"] = base
    from ascendserve.connectors.transport import native

    print(f"NATIVE {int(native.enabled())}", flush=True)  # which I/O path this producer serves with
    print("PORTS " + json.dumps(ports), flush=True)
    sys.stdin.read()
    for server in servers:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
