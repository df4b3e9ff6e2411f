"""Page and state-slot allocators: the only code that changes which pages and slot a request owns.

Pages are reference-counted (prefix_cache.PageCache): a request's block table may start with pages it
shares with the prefix cache and other requests; freeing a request releases its references."""

from __future__ import annotations

from .prefix_cache import PageCache
from .request import Request


class BlockAllocator:
    """KV pages of `block_size` tokens. Page `reserved` (the last) is never handed out: padded rows
    of a CUDA-graph batch write there."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.cache = PageCache(num_blocks, block_size, enable_caching)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.reserved = self.cache.reserved

    @property
    def num_free(self) -> int:
        return self.cache.num_free

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        """Extra pages `req` needs to hold `num_tokens` tokens."""
        have = len(req.block_table)
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.pages_needed(req, num_tokens) <= self.num_free

    def grow(self, req: Request, num_tokens: int) -> None:
        need = self.pages_needed(req, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV pages: {req.req_id} needs {need}, {self.num_free} free")
        req.block_table.extend(self.cache.allocate() for _ in range(need))

    def share(self, req: Request, pages: list[int]) -> None:
        """Start an empty block table with cached pages (a prefix-cache hit)."""
        if req.block_table:
            raise RuntimeError(f"{req.req_id} already holds pages")
        self.cache.hold_all(pages)
        req.block_table = list(pages)

    def free(self, req: Request) -> None:
        for page in reversed(req.block_table):
            self.cache.release(page)
        req.block_table = []


class StateSlotAllocator:
    """GDN state slots, one per running request. Slot `reserved` (the last) is scratch for padding."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"need at least 2 GDN state slots, got {num_slots}")
        self.num_slots = num_slots
        self.reserved = num_slots - 1
        self._free = list(range(num_slots - 2, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    def allocate(self, req: Request) -> None:
        if req.state_slot is not None:
            raise RuntimeError(f"{req.req_id} already holds slot {req.state_slot}")
        if not self._free:
            raise RuntimeError("out of GDN state slots")
        req.state_slot = self._free.pop()

    def free(self, req: Request) -> None:
        if req.state_slot is not None:
            self._free.append(req.state_slot)
            req.state_slot = None
