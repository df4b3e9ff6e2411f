"""Page and state-slot allocators: the only code that changes which pages and slot a request owns."""

from __future__ import annotations

from .request import Request


class BlockAllocator:
    """KV pages of `block_size` tokens. Page `reserved` (the last) is never handed out: padded rows
    of a CUDA-graph batch write there."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV pages, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.reserved = num_blocks - 1
        self._free = list(range(num_blocks - 2, -1, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def pages_needed(self, req: Request, num_tokens: int) -> int:
        """Extra pages `req` needs to hold `num_tokens` tokens."""
        have = len(req.block_table)
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.pages_needed(req, num_tokens) <= len(self._free)

    def grow(self, req: Request, num_tokens: int) -> None:
        need = self.pages_needed(req, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV pages: {req.req_id} needs {need}, {len(self._free)} free")
        req.block_table.extend(self._free.pop() for _ in range(need))

    def free(self, req: Request) -> None:
        self._free.extend(reversed(req.block_table))
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
