"""Heterogeneous tensor parallelism: which P rank supplies which KV heads of a D rank.

vLLM shards KV heads over TP ranks: with H heads and TP t, each rank holds
H / t consecutive heads when H >= t; when H < t each head is replicated on
t / H consecutive ranks and every rank holds one. P_tp must be a multiple of
D_tp (P_tp >= D_tp), so every D rank's heads are the union of whole P ranks'
heads (or of one replica of each). When a head is replicated, the replica is
picked from a stable hash of the request id, so P and D (and every D rank)
agree without talking, and the load spreads over the replicas.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    p_rank: int
    p_head: int  # first head, in P rank's local numbering
    d_head: int  # first head, in D rank's local numbering
    heads: int


def check_tp(p_tp: int, d_tp: int) -> None:
    if p_tp < 1 or d_tp < 1 or p_tp < d_tp or p_tp % d_tp:
        raise ValueError(f"prefill TP {p_tp} and decode TP {d_tp} cannot exchange KV: ascendserve needs "
                         f"prefill TP >= decode TP and prefill TP a multiple of decode TP")


def local_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first global head, count) held by `rank`."""
    if total >= tp:
        if total % tp:
            raise ValueError(f"{total} KV heads do not split over TP {tp}")
        per = total // tp
        return rank * per, per
    if tp % total:
        raise ValueError(f"{total} KV heads cannot be replicated evenly over TP {tp}")
    return rank // (tp // total), 1


def source_ranks(p_tp: int, d_tp: int, d_rank: int) -> range:
    """The P ranks D rank `d_rank` reads from (a replica always exists among them) and
    frees when done; no other D rank touches them, so reads never race a free."""
    check_tp(p_tp, d_tp)
    k = p_tp // d_tp
    return range(d_rank * k, (d_rank + 1) * k)


def plan(total: int, p_tp: int, d_tp: int, d_rank: int, request_id: str) -> list[Segment]:
    """Where D rank `d_rank` gets each of its heads for one request."""
    first, count = local_heads(total, d_tp, d_rank)
    pick = zlib.crc32(request_id.encode())
    segments: list[Segment] = []
    group = source_ranks(p_tp, d_tp, d_rank)
    for h in range(first, first + count):
        holders = [r for r in group if local_heads(total, p_tp, r)[0] <= h < sum(local_heads(total, p_tp, r))]
        rank = holders[pick % len(holders)]
        p_head, d_head = h - local_heads(total, p_tp, rank)[0], h - first
        last = segments[-1] if segments else None
        if last and last.p_rank == rank and last.p_head + last.heads == p_head and last.d_head + last.heads == d_head:
            segments[-1] = Segment(rank, last.p_head, last.d_head, last.heads + 1)
        else:
            segments.append(Segment(rank, p_head, d_head, 1))
    return segments
