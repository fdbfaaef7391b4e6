"""The encoder hop of a request with multimodal parts (pipeline.py runs it before P/PD).

Only when the request has multimodal parts and encoders exist; skipped when the EC store
already holds every item (the proxy hashes them as vLLM does: router/ec.py). `single` sends
the request once, `fanout` one request per item, concurrently. max_tokens=1: the encoder only
publishes the EC; its ec_transfer_params go on to P/PD, which wait briefly for items still
being saved. All encoders down -> PD/P encode locally (`encoder_fallback=local`) or 503
(`fail`). An encoder's 4xx (bad image) goes to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from ascendserve.config import ProxyConfig
from ascendserve.connectors.ec.memcached import StoreError
from ascendserve.protocol.openai import APIError, mm_parts, only_part
from ascendserve.router import tracing
from ascendserve.router.ec import ECLookup
from ascendserve.router.media import encoder_tokens, image_size, part_url
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.pools import Pools

log = structlog.get_logger("ascendserve.router")
# one encoder call: (body, headers, cost in tokens) -> the encoder's answer, retried on other encoders
Call = Callable[[dict, dict, int], Awaitable[dict]]


class Encoders:
    """`run` once per request with multimodal parts (pipeline.py); `call` is one encoder request,
    retried on other encoders (the pipeline's retries and leases)."""

    def __init__(self, pools: Pools, settings: ProxyConfig, metrics: ProxyMetrics, ec_lookup: ECLookup | None,
                 call: Call):
        self.pools, self.settings, self.metrics, self.ec_lookup, self.call = pools, settings, metrics, ec_lookup, call
        self._roots_warned = False

    async def run(self, body: dict, headers: dict) -> dict | None:
        """Run the encoder hop if needed; the encoders' ec_transfer_params for P/PD."""
        parts = mm_parts(body)
        if not parts:
            return None
        self._check_sizes([p for _, _, p in parts])
        if await self._all_in_store([p for _, _, p in parts], headers["x-request-id"]):
            return None
        if not self.pools.has_active("encoder"):
            if self.pools["encoder"].instances:  # encoders exist, none is healthy
                self._fallback("no healthy encoder")
            return None
        if self.settings.encoder_dispatch == "fanout" and len(parts) > 1:
            jobs = [(only_part(body, i, j), [p]) for i, j, p in parts]
        else:
            jobs = [(body, [p for _, _, p in parts])]
        try:
            replies = await asyncio.gather(*(self._one(b, items, headers) for b, items in jobs))
        except APIError as exc:
            if exc.status < 500:
                raise
            self._fallback(exc.message)
            return None
        merged: dict = {}
        for reply in replies:
            params = reply.get("ec_transfer_params") if isinstance(reply, dict) else None
            if isinstance(params, dict):
                merged.update(params)
        return merged or None

    def _fallback(self, why: str) -> None:
        """The encoder hop cannot run: P/PD encode the items themselves, or 503 (`encoder_fallback=fail`)."""
        if self.settings.encoder_fallback == "fail":
            raise APIError(503, f"encoder unavailable: {why[:200]}", type="service_unavailable",
                           code="encoder_unavailable")
        self.metrics.fallbacks.inc()
        tracing.event("encoder_fallback", reason=why[:200])
        log.warning("encoder unavailable; the next instance encodes locally", detail=why[:200])

    def _check_sizes(self, parts: list[dict]) -> None:
        """Refuse images whose header claims more pixels than the engines accept, before any hop."""
        for part in parts:
            size = image_size(part_url(part))
            if size and size[0] * size[1] > self.settings.max_image_pixels:
                raise APIError(400, f"image of {size[0]}x{size[1]} pixels is above the limit of "
                               f"{self.settings.max_image_pixels} pixels", param="messages", code="image_too_large")

    async def _all_in_store(self, parts: list[dict], request_id: str) -> bool:
        if self.ec_lookup is None:
            return False
        model_id = self.pools.model_root(("pd", "prefill", "encoder"))
        encoder_root = self.pools.model_root(("encoder",))
        if encoder_root and model_id and encoder_root != model_id and not self._roots_warned:
            self._roots_warned = True
            log.warning("encoders and P/PD serve different model paths; vLLM's mm_hash includes the path, "
                        "so no encoder output can ever be reused: start them with the same --model path",
                        encoder=encoder_root, consumer=model_id)
        hashes = self.ec_lookup.hashes(parts, model_id) if model_id else None
        if not hashes:
            return False
        try:
            present = await self.ec_lookup.present(hashes)
        except (StoreError, asyncio.TimeoutError) as exc:
            self.metrics.ec_store_errors.inc()
            if self.settings.encoder_fallback == "fail":
                raise APIError(503, f"EC store unavailable: {str(exc)[:200]}", type="service_unavailable",
                               code="ec_store_unavailable") from None
            log.warning("EC store unreachable; asking the encoder (P/PD encode if they cannot reach it either)",
                        detail=str(exc)[:200])
            return False
        if len(present) < len(set(hashes)):
            return False
        self.metrics.encoder_skips.inc()
        tracing.event("encoder_skipped", items=len(hashes))
        log.info("every item is in the EC store; encoder hop skipped", items=len(hashes))
        return True

    async def _one(self, body: dict, items: list[dict], headers: dict) -> dict:
        e_body = dict(body, max_tokens=1, stream=False)
        e_body.pop("max_completion_tokens", None)
        e_body.pop("stream_options", None)
        cost = encoder_tokens(items)
        return await self.call(e_body, headers, cost)
