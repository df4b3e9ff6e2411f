"""LoRA adapters on the driver: `LoRARequest` (vLLM's), the registry of adapters by id and name,
and the device slots they occupy.

An adapter is checked when it is registered (its config, and every tensor's shape against the base
model and the rank limit, from the file headers), so a bad adapter is a ValueError naming the file
and field before anything reaches a worker. Each running request on an adapter pins the slot that
holds it; a request whose adapter is not on the device takes a free slot, or the least recently
used unpinned one, and the next plan carries the load (`LoraLoad`). When every slot is pinned by
other adapters the request waits. Each registration has its own `key`, which is also the prefix
cache key of its requests: requests on different adapters (or on a re-registered one) never share
cached blocks or GDN snapshots.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.lora import LoraError, match_adapter
from deltaserve.workers.config import LoraConfig, short
from deltaserve.workers.plan import LoraLoad


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (what a request or the HTTP `model` field names), an id unique among the
    engine's adapters (>= 1), and its folder (PEFT's adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > 256:
            raise ValueError("lora_name: must be a non-empty string of at most 256 characters")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {short(self.lora_int_id)}")
        if not isinstance(self.lora_path, str | Path) or not str(self.lora_path):
            raise ValueError("lora_path: must be a path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return str(self.lora_path)


@dataclass
class Adapter:
    """A registered adapter: its request, the registration's key and whether it adapts routed experts."""

    request: LoRARequest
    key: int
    rank: int
    has_experts: bool
    removed: bool = False

    @property
    def cache_key(self) -> str:
        return f"lora:{self.key}"


@dataclass
class _Slot:
    adapter: Adapter | None = None
    pins: int = 0


@dataclass
class AdapterRegistry:
    config: LoraConfig
    model_config: ModelConfig
    by_id: dict[int, Adapter] = field(default_factory=dict)
    by_name: dict[str, Adapter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._keys = itertools.count(1)
        self._targets = None
        self.slots = [_Slot() for _ in range(self.config.max_loras if self.config.enable_lora else 0)]
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(len(self.slots)))
        self._loads: list[LoraLoad] = []

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora

    # ---- registration ----------------------------------------------------------------------
    def _model_targets(self):
        if self._targets is None:  # the model's modules and shapes, built on the meta device (no memory)
            from deltaserve.layers.loader import build_model

            self._targets = build_model(self.model_config, device="meta").lora_targets()
        return self._targets

    def add(self, request: LoRARequest) -> Adapter:
        """Register an adapter after checking it against the model (ValueError naming the file and the
        field or tensor). The same request again is a no-op; an id or name in use by another is an error."""
        if not self.enabled:
            raise ValueError("lora_request: this engine runs without enable_lora")
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(request).__name__}")
        known = self.by_id.get(request.lora_int_id)
        if known is not None:
            if known.request != request:
                raise ValueError(
                    f"lora_int_id: {request.lora_int_id} is registered as {short(known.request.lora_name)} at "
                    f"{short(known.request.path)}"
                )
            return known
        if request.lora_name in self.by_name:
            other = self.by_name[request.lora_name].request.lora_int_id
            raise ValueError(f"lora_name: {short(request.lora_name)} is in use by adapter id {other}")
        entries = match_adapter(
            self._model_targets(), request.path, max_lora_rank=self.config.max_lora_rank,
            experts=self.config.enable_expert_lora,
        )  # fmt: skip
        rank, experts = max(e.rank for e in entries), any(e.target.expert for e in entries)
        adapter = Adapter(request, next(self._keys), rank, experts)
        self.by_id[request.lora_int_id] = self.by_name[request.lora_name] = adapter
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter: new requests cannot name it; running ones finish on it."""
        adapter = self.by_id.pop(lora_int_id, None)
        if adapter is None:
            return False
        del self.by_name[adapter.request.lora_name]
        adapter.removed = True
        for slot in self.slots:
            if slot.adapter is adapter and not slot.pins:
                slot.adapter = None
        return True

    def lookup(self, name: str) -> LoRARequest | None:
        """The registered adapter of this name (the front doors' name -> adapter lookup)."""
        adapter = self.by_name.get(name)
        return None if adapter is None else adapter.request

    def resolve(self, request: LoRARequest | None) -> Adapter | None:
        """The adapter a request runs on (registered on first use, like vLLM's generate)."""
        return None if request is None else self.add(request)

    def list(self) -> list[LoRARequest]:
        return [a.request for a in self.by_id.values()]

    # ---- device slots ------------------------------------------------------------------------
    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding `adapter`, pinned for one request; None when every slot is pinned by others."""
        for s, slot in enumerate(self.slots):
            if slot.adapter is adapter:
                return self._pin(s)
        empty = [s for s in self._lru if self.slots[s].adapter is None]
        for s in empty + list(self._lru):  # an empty slot, else the least recently used unpinned one
            slot = self.slots[s]
            if not slot.pins:
                slot.adapter = adapter
                self._loads = [x for x in self._loads if x.slot != s]
                self._loads.append(LoraLoad(s, adapter.key, adapter.request.lora_name, adapter.request.path))
                return self._pin(s)
        return None

    def _pin(self, s: int) -> int:
        self.slots[s].pins += 1
        self._lru.move_to_end(s)
        return s

    def release(self, s: int) -> None:
        slot = self.slots[s]
        slot.pins -= 1
        if not slot.pins and slot.adapter is not None and slot.adapter.removed:
            slot.adapter = None

    def take_loads(self) -> list[LoraLoad]:
        """The loads the next plan carries (each slot's latest)."""
        loads, self._loads = self._loads, []
        return loads

    def reset_device(self) -> None:
        """The workers were replaced: no slot holds anything any more."""
        for slot in self.slots:
            slot.adapter, slot.pins = None, 0
        self._loads = []


__all__ = ["Adapter", "AdapterRegistry", "LoRARequest", "LoraError"]
