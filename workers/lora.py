"""A rank's LoRA adapter slots: what each device slot holds, the adapters loaded into host memory
(an LRU of max_cpu_loras, so that an adapter evicted from the device comes back without reading its
file), and each pass's MoE-LoRA route. The driver chooses the slots (cluster/core/lora.py); a plan's
`lora_loads` place adapters before its forward, its `lora_slots` name each row's."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from deltaserve.layers.base import MoeLoraRoute
from deltaserve.layers.lora import (
    LoadedAdapter,
    enable_lora,
    load_adapter,
    marked_present,
    slot_has_experts,
    write_slot,
)
from deltaserve.workers.config import LoraConfig
from deltaserve.workers.plan import LoraLoad
from deltaserve.workers.wire import WireError

log = logging.getLogger(__name__)


class AdapterSlots:
    def __init__(self, model: torch.nn.Module, config: LoraConfig):
        self.model, self.config = model, config
        enable_lora(
            model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, experts=config.enable_expert_lora
        )
        self.held: list[LoraLoad | None] = [None] * config.max_loras
        self.has_experts = [False] * config.max_loras
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # key -> this rank's tensors, LRU order

    @property
    def num_slots(self) -> int:
        return self.config.max_loras

    def place(self, loads: list[LoraLoad]) -> None:
        """Copy each adapter into its slot (from host memory, or its file the first time)."""
        for load in loads:
            adapter = self.host.get(load.key)
            if adapter is None:
                adapter = load_adapter(
                    self.model, load.path, max_lora_rank=self.config.max_lora_rank,
                    experts=self.config.enable_expert_lora,
                )  # fmt: skip
                self.host[load.key] = adapter
                while len(self.host) > self.config.cpu_loras:
                    self.host.popitem(last=False)
                log.info("loaded adapter %s (%.1f MiB on this rank)", load.name, adapter.nbytes / 2**20)
            self.host.move_to_end(load.key)
            write_slot(self.model, load.slot, adapter)
            self.held[load.slot] = load
            self.has_experts[load.slot] = slot_has_experts(self.model, load.slot)

    def route(self, lora_slots: np.ndarray | None) -> MoeLoraRoute:
        """The pass's MoE route: FOLD when a row's adapter has expert weights, else SKIP. A row naming
        an empty slot is an error naming the slot."""
        if lora_slots is None:
            return MoeLoraRoute.SKIP
        used = {int(s) for s in np.unique(lora_slots) if s >= 0}
        for s in used:
            if self.held[s] is None:
                raise WireError(f"plan field 'lora_slots' names slot {s}, which holds no adapter")
        return MoeLoraRoute.FOLD if any(self.has_experts[s] for s in used) else MoeLoraRoute.SKIP

    @contextmanager
    def warmup_adapters(self, slots: Sequence[int]) -> Iterator[None]:
        """Start-up warm-up: inside the block, `slots` hold an adapter of the slots' rank on every
        target the engine adapts (routed experts included when enabled): a pass's rows may name them
        and run every adapter kernel. Nothing is written to the weights (zeros before any load: the
        deltas are zero), and what each slot holds, as the driver's AdapterRegistry knows it (every
        slot empty at start-up), is restored after."""
        held, has_experts = list(self.held), list(self.has_experts)
        try:
            with marked_present(self.model, slots):
                for s in slots:
                    if self.held[s] is None:
                        self.held[s] = LoraLoad(s, -1, "warm-up", "")
                    self.has_experts[s] = slot_has_experts(self.model, s)
                yield
        finally:
            self.held[:], self.has_experts[:] = held, has_experts
