"""Routers: which engine replica takes a request.

`LeastLoaded` (the default): the replica with the fewest requests in flight, ties taken in turn.
`PrefixAware`: among the replicas not far busier than the least loaded one, the one whose prefix cache
holds the most leading blocks of the prompt (a `PrefixMirror` of each replica's page index, kept from
the events its driver sends with each poll, plus the prompts routed there since); without any match,
the least loaded. The load slack keeps a popular prefix from piling every request onto one replica.

A router sees replicas only through `Routable`: their in-flight count and their mirror.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from deltaserve.cluster.core.prefix_cache import PrefixMirror, prompt_block_hashes

# a replica with at most this many more requests in flight than the least loaded one (or this share
# more) may still take a request for its cached prefix
PREFIX_SLACK_REQUESTS = 4
PREFIX_SLACK_SHARE = 0.25


class Routable(Protocol):
    in_flight: int
    mirror: PrefixMirror | None


class LeastLoaded:
    needs_token_ids = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, replicas: Sequence[Routable], token_ids: Sequence[int] | None = None, cache_key: str = "") -> int:
        """The index (into `replicas`, not empty) of the replica to take the request."""
        low = min(r.in_flight for r in replicas)
        tied = [i for i, r in enumerate(replicas) if r.in_flight == low]
        self._turn += 1
        return tied[self._turn % len(tied)]


class PrefixAware:
    needs_token_ids = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._least_loaded = LeastLoaded()

    def choose(self, replicas: Sequence[Routable], token_ids: Sequence[int] | None = None, cache_key: str = "") -> int:
        """As LeastLoaded's; `cache_key`: the request's (its salt's), under which its blocks hash."""
        hashes = prompt_block_hashes(token_ids, self.block_size, cache_key) if token_ids else []
        low = min(r.in_flight for r in replicas)
        slack = max(PREFIX_SLACK_REQUESTS, int(PREFIX_SLACK_SHARE * low))
        best, best_blocks = None, 0
        for i, r in enumerate(replicas):
            if r.mirror is None or r.in_flight > low + slack:
                continue
            blocks = r.mirror.matched_blocks(hashes) if hashes else 0
            if blocks > best_blocks or (blocks == best_blocks and best is not None and r.in_flight < best[1]):
                best, best_blocks = (i, r.in_flight), blocks
        chosen = best[0] if best is not None and best_blocks > 0 else self._least_loaded.choose(replicas)
        mirror = replicas[chosen].mirror
        if mirror is not None and hashes:
            mirror.expect(hashes)  # its blocks are cached there once prefilled: the next such prompt follows
        return chosen


def make_router(routing: str, block_size: int) -> LeastLoaded | PrefixAware:
    """The router DataParallelConfig.routing names."""
    if routing == "prefix_aware":
        return PrefixAware(block_size)
    if routing == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"routing: unknown router {routing!r}")
