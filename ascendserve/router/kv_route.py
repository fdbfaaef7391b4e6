"""KV-event-aware choice of a pd or prefill instance: cached prompt blocks against load.

For a text request the proxy takes the prompt's token ids as the engine will see them
(a token-id prompt as sent; a text completion through the model's own tokenizer file when the
proxy can read the model directory; a plain chat through the model's chat template rendered
here too (router/chat_template.py); anything else, or without the model's files, through the
engine's /tokenize, which applies the engine's chat template with the request's own template
settings; /tokenize costs a round trip to an engine), hashes its full blocks as
the engine does (router/block_hash.py: the instance's hash algorithm, seed and block size) and
asks each instance's index (router/kv_index.py) how many of them it holds from the first.
Each candidate costs

    overlap_weight x (prompt blocks - blocks it holds) + its tokens in flight / block size

(NVIDIA Dynamo's KV router scores workers alike) and the cheapest wins; with a temperature
the choice is drawn with probabilities softmax(-cost / (temperature x prompt blocks)).
By load instead: a single candidate, an instance whose index is unknown (router/kv_index.py),
multimodal or LoRA requests or a `cache_salt` (their blocks carry extra keys), prompts shorter
than a block, or token ids the proxy could not get.

A local tokenization (text or chat) is checked against the prompt ids the engine returns (the
ledger asks for them): a model whose ids differ is tokenized by the engine from then on.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass, field

import structlog

from ascendserve.config import ProxyConfig
from ascendserve.protocol.openai import mm_parts
from ascendserve.router.block_hash import BlockHasher
from ascendserve.router.chat_template import LocalChat
from ascendserve.router.kv_index import CacheIndex, KVEvents
from ascendserve.router.pools import Instance, Pool, Pools
from ascendserve.web.upstream import Upstream, UpstreamError

log = structlog.get_logger("ascendserve.router.kv_route")

CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                        "tools", "documents", "add_special_tokens", "mm_processor_kwargs")
LOCAL_OFFLOAD_CHARS = 20_000  # longer prompts are tokenized off the event loop


@dataclass
class Plan:
    """One request's prompt, as blocks each candidate holds."""

    role: str
    prompt_tokens: int
    ids: list[int]
    source: str  # how the ids were obtained: ids | local | engine
    model: str
    overlap: dict[str, int] = field(default_factory=dict)  # url -> prompt tokens it holds
    blocks: dict[str, int] = field(default_factory=dict)  # url -> its block size
    chosen: Instance | None = None

    def predicted(self) -> int:
        return self.overlap.get(self.chosen.url, 0) if self.chosen is not None else 0


class KVRouter:
    def __init__(self, pools: Pools, upstream: Upstream, events: KVEvents, settings: ProxyConfig, metrics,
                 rng: random.Random | None = None):
        self.pools, self.upstream, self.events, self.settings, self.metrics = pools, upstream, events, settings, metrics
        self.rng = rng or random.Random()
        self._hashers: dict[tuple[str, str], BlockHasher] = {}
        self._tokenizers: dict[str, object | None] = {}
        self._chats: dict[str, LocalChat | None] = {}
        self._engine_only: set[str] = set()  # models whose local ids differed from the engine's
        self._unhashable_warned: set[str] = set()

    # ---- the plan ----------------------------------------------------------------------
    async def plan(self, kind: str, body: dict, role: str, headers: dict,
                   known: tuple[list[int], str] | None = None) -> Plan | None:
        """The request's blocks on each candidate of `role`; None: choose by load. `known`: the
        token ids (and their source) a plan of the same request already has."""
        candidates = self.pools[role].active()
        if len(candidates) < 2:
            return self._by_load(role, "single")
        if (kind == "chat" and mm_parts(body)) or body.get("cache_salt") or self._is_lora(body.get("model"), candidates):
            return self._by_load(role, "unsupported")
        indexes = {i.url: self.events.get(i.url) for i in candidates}
        if any(idx is None or not idx.known for idx in indexes.values()):
            return self._by_load(role, "unknown")
        started = time.monotonic()
        got = known or await self._token_ids(kind, body, candidates, headers)
        if got is None:
            return self._by_load(role, "no_token_ids")
        ids, source = got
        self.metrics.kv_tokenize.labels(source).observe(time.monotonic() - started)
        if len(ids) < min((idx.block_size for idx in indexes.values() if idx.block_size), default=1):
            return self._by_load(role, "short")  # not one whole block: nothing to find anywhere
        plan = Plan(role, len(ids), ids, source, body.get("model", ""))
        memo: dict[tuple, list[int] | None] = {}  # instances that hash alike share the keys
        for url, idx in indexes.items():
            alike = (idx.info.hash_algo, idx.info.hash_seed, idx.block_size, idx.info.hash_block_size)
            keys = memo[alike] if alike in memo else memo.setdefault(alike, self._keys(idx, ids))
            if keys is None:
                return self._by_load(role, "unhashable")
            plan.blocks[url] = idx.block_size or 1
            plan.overlap[url] = idx.overlap(keys) * plan.blocks[url] if keys else 0
        self.metrics.kv_routing.labels(role, "kv").inc()
        return plan

    def _by_load(self, role: str, why: str) -> None:
        self.metrics.kv_routing.labels(role, why).inc()
        return None

    @staticmethod
    def _is_lora(model, candidates: list[Instance]) -> bool:
        """A LoRA adapter: vLLM lists it with the base model as its `parent`."""
        for inst in candidates:
            for card in inst.cards:
                if card.get("id") == model and card.get("parent"):
                    return True
        return False

    def _keys(self, idx: CacheIndex, ids: list[int]) -> list[int] | None:
        info = idx.info
        if info.hash_seed is None:
            if idx.url not in self._unhashable_warned:
                self._unhashable_warned.add(idx.url)
                log.warning("the instance hashes its blocks with a seed the proxy cannot know (xxhash without a "
                            "shared PYTHONHASHSEED): routing to it by load; use --prefix-caching-hash-algo sha256",
                            url=idx.url, algo=info.hash_algo)
            return None
        if not idx.block_size:
            return []  # nothing stored yet: no block can match
        key = (info.hash_algo, info.hash_seed)
        hasher = self._hashers.get(key)
        if hasher is None:
            try:
                hasher = self._hashers[key] = BlockHasher(info.hash_algo, info.hash_seed)
            except (ValueError, ImportError) as exc:
                if idx.url not in self._unhashable_warned:
                    self._unhashable_warned.add(idx.url)
                    log.warning("cannot hash blocks as the instance does; routing to it by load", url=idx.url,
                                error=str(exc))
                return None
        unit = info.hash_block_size or idx.block_size
        if idx.block_size % unit:
            return None
        step = idx.block_size // unit
        keys = hasher.keys(ids, unit)
        return keys[step - 1::step] if step > 1 else keys

    # ---- token ids -----------------------------------------------------------------------
    async def _token_ids(self, kind: str, body: dict, candidates: list[Instance],
                         headers: dict) -> tuple[list[int], str] | None:
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                return list(prompt), "ids"
            if not isinstance(prompt, str):
                return None
            ids = await self._local_ids(body.get("model", ""), prompt, body.get("add_special_tokens", True),
                                        candidates)
            if ids is not None:
                return ids, "local"
            tok = {"model": body.get("model"), "prompt": prompt}
            if "add_special_tokens" in body:
                tok["add_special_tokens"] = body["add_special_tokens"]
        else:
            text = self._local_chat(body, candidates)
            if text is not None and (ids := await self._local_ids(body.get("model", ""), text,
                                                                  body.get("add_special_tokens", False),
                                                                  candidates)) is not None:
                return ids, "local"
            tok = {"model": body.get("model"), "messages": body.get("messages")}
            tok |= {k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body}
        ids = await self._engine_ids(tok, candidates, headers)
        return (ids, "engine") if ids is not None else None

    async def _local_ids(self, model: str, prompt: str, special: bool, candidates: list[Instance]) -> list[int] | None:
        """The ids from the model's tokenizer file, or None (not readable here, the setting says
        engine, or the tokenizer refused the text); a long text is encoded off the event loop."""
        if self.settings.kv_tokenizer == "engine" or model in self._engine_only:
            return None
        root = next((i.root for i in candidates if i.root), "")
        tokenizer = self._tokenizer(root)
        if tokenizer is None:
            return None

        def encode() -> list[int] | None:
            try:
                return tokenizer.encode(prompt, add_special_tokens=bool(special)).ids
            except Exception:  # a tokenizer that cannot take this text: ask the engine
                return None

        return await asyncio.to_thread(encode) if len(prompt) > LOCAL_OFFLOAD_CHARS else encode()

    def _local_chat(self, body: dict, candidates: list[Instance]) -> str | None:
        """A plain chat's prompt text rendered here (router/chat_template.py), or None."""
        model = body.get("model", "")
        if self.settings.kv_tokenizer == "engine" or model in self._engine_only:
            return None
        root = next((i.root for i in candidates if i.root), "")
        if root not in self._chats:
            self._chats[root] = LocalChat.load(root) if root and os.path.isdir(root) else None
        chat = self._chats[root]
        return chat.render(body) if chat is not None else None

    def _tokenizer(self, root: str):
        if root in self._tokenizers:
            return self._tokenizers[root]
        tokenizer = None
        path = os.path.join(root, "tokenizer.json") if root else ""
        if path and os.path.isfile(path):
            try:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_file(path)
            except Exception as exc:  # not a tokenizers file this version reads: the engine tokenizes
                log.warning("the model's tokenizer file cannot be read here; the engines tokenize for routing",
                            path=path, error=str(exc)[:200])
        self._tokenizers[root] = tokenizer
        return tokenizer

    async def _engine_ids(self, tok: dict, candidates: list[Instance], headers: dict) -> list[int] | None:
        inst = min(candidates, key=lambda i: i.priority)
        try:
            reply = await self.upstream.post_json(inst.url + "/tokenize", tok, headers)
        except UpstreamError as exc:
            log.info("tokenize for routing failed; routing by load", url=inst.url, status=exc.status,
                     detail=exc.detail[:200])
            return None
        ids = reply.get("tokens") if isinstance(reply, dict) else None
        return ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None

    def check_ids(self, plan: Plan | None, prompt_ids: list[int] | None) -> None:
        """The engine's prompt ids for a request planned with local ones: a model whose ids
        differ is tokenized by the engine from then on."""
        if plan is None or plan.source != "local" or not prompt_ids or plan.model in self._engine_only:
            return
        if list(prompt_ids) != plan.ids:
            self._engine_only.add(plan.model)
            self.metrics.kv_tokenizer_mismatch.inc()
            log.warning("the model's tokenizer file gives other ids than the engine; the engines tokenize for "
                        "routing from now on", model=plan.model, local=len(plan.ids), engine=len(prompt_ids))

    # ---- the choice ----------------------------------------------------------------------
    def pick(self, plan: Plan, pool: Pool, exclude: frozenset[str]) -> Instance | None:
        candidates = [i for i in pool.active() if i.url not in exclude]
        if not candidates:
            return None
        w = self.settings.kv_overlap_weight
        costs = []
        for inst in candidates:
            block = plan.blocks.get(inst.url, 1)
            uncached = max(0, plan.prompt_tokens - plan.overlap.get(inst.url, 0))
            costs.append(w * uncached / block + inst.priority / block)
        t = self.settings.kv_temperature
        if t <= 0:  # the cheapest; among equals, the one the load balancer would take (it rotates)
            least = pool.select(exclude)
            chosen = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i] is not least,
                                                                candidates[i].priority))
        else:
            scale = t * max(1.0, plan.prompt_tokens / max(plan.blocks.values(), default=1))
            low = min(costs)
            weights = [math.exp(-(c - low) / scale) for c in costs]
            chosen = self.rng.choices(range(len(candidates)), weights)[0]
        plan.chosen = candidates[chosen]
        return plan.chosen

    def routed(self, plan: Plan | None) -> None:
        """The plan's request was sent: predicted overlap counted; an event should follow."""
        if plan is None or plan.chosen is None:
            return
        self.metrics.prefix_predicted.labels(plan.role).inc(plan.predicted())
        if plan.prompt_tokens - plan.predicted() >= plan.blocks.get(plan.chosen.url, 1):
            self.events.expect(plan.chosen.url)
