"""CUDA graphs for decode passes.

A decode pass (every row one token of a cached sequence) is captured once per batch size with
static metadata buffers; at run time the plan's arrays are copied into those buffers, padded to the
captured size, and the graph is replayed. Padding rows write no KV (slot -1) and run their GDN
update on the reserved scratch slot, so they touch no request's state.

Nothing waits for the device: the small fields go through pinned staging buffers (two, used in
turn, each reused only after the event recorded behind its copies has passed, so a pass can be
staged while the previous one still runs), and rows whose input id the previous pass sampled
(`input_from_prev`) take it from that pass's ids on the device before the replay.

With LoRA adapters a second set of graphs is captured with every projection's adapters in it: a
pass whose rows name adapter slots replays it, each row's slot staged like its other fields (the
graph groups the rows by slot on the device); padding rows and base-model rows have slot -1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from deltaserve.layers.base import ForwardContext, LoraBatch, MoeLoraRoute
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.model import HybridModel
from deltaserve.workers.context import decode_context
from deltaserve.workers.lora import AdapterSlots
from deltaserve.workers.plan import PassPlan

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


# rows of the small-field staging buffer
_IDS, _POS, _SLOT, _LEN, _STATE, _PREV, _LORA = range(7)
_NUM_FIELDS = 7


class DecodeGraphs:
    def __init__(
        self,
        model: HybridModel,
        layer_states: list,
        *,
        max_pages: int,
        scratch_slot: int,
        scratch_page: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        device: torch.device,
        kernels: KernelOptions,
        lora: AdapterSlots | None = None,
    ):
        self.model, self.layer_states, self.device = model, layer_states, device
        self.lora = lora
        self.kernels = kernels  # the kernel choices every graph was captured with
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_batch = n = self.batch_sizes[-1]
        self.max_pages = max_pages
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        # small fields: pinned staging (two buffers in turn), one H2D copy per replay
        self._staging = [torch.zeros(_NUM_FIELDS * n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.fields = torch.zeros((_NUM_FIELDS, n), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # block tables: only the [rows, pages] corner a pass uses is copied
        self._staging_tables = [torch.zeros(n * max_pages, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._staged = [torch.cuda.Event(), torch.cuda.Event()]  # recorded after each buffer's copies
        self._turn = 0
        self.block_tables = torch.full((n, max_pages), scratch_page, dtype=torch.int32, device=device)
        # (batch size, with adapters) -> graph and its logits
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()  # shared with the prefill graphs (runner.py)
        self._capture_all()

    def _context(self, bs: int, with_lora: bool = False) -> ForwardContext:
        f = self.fields
        ctx = decode_context(
            config=self.model.config,
            layout=self.model.layout,
            kernels=self.kernels,
            input_ids=f[_IDS, :bs],
            positions=f[_POS, :bs],
            slot_mapping=f[_SLOT, :bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            state_slots=f[_STATE, :bs],
        )
        if with_lora:  # every slot may be named at replay: the capture runs every adapter op
            slots = self.lora.num_slots
            ctx.lora = LoraBatch(f[_LORA, :bs], slots, frozenset(range(slots)), capture=True)
            ctx.moe_lora_route = MoeLoraRoute.FOLD
        return ctx

    def _stage_padding(self, h: torch.Tensor, start: int) -> None:
        """Rows from `start` on: no KV write, the scratch slot, one cached token on the scratch page."""
        h[_IDS, start:] = 0
        h[_POS, start:] = 0
        h[_SLOT, start:] = -1
        h[_LEN, start:] = 1
        h[_STATE, start:] = self.scratch_slot
        h[_PREV, start:] = -1
        h[_LORA, start:] = -1

    def _staging_buffers(self, bs: int, pages: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The next pinned staging pair as [fields, bs] and [bs * pages]; waits (in practice never)
        until the copies of the pass that used it last have run."""
        turn = self._turn
        self._turn ^= 1
        if not self._staged[turn].query():  # recorded a pass ago or more: in practice always passed
            self._staged[turn].synchronize()
        fields = self._staging[turn][: _NUM_FIELDS * bs].view(_NUM_FIELDS, bs)
        return fields, self._staging_tables[turn], turn

    def _upload(self, h: torch.Tensor, bs: int) -> None:
        self.fields[:, :bs].copy_(h, non_blocking=True)
        self.seq_lens[:bs].copy_(self.fields[_LEN, :bs])

    def _capture_all(self) -> None:
        h, _, _ = self._staging_buffers(self.max_batch, 0)
        self._stage_padding(h, 0)
        self._upload(h, self.max_batch)
        for with_lora in (False, True) if self.lora is not None else (False,):
            contexts = {bs: self._context(bs, with_lora) for bs in self.batch_sizes}
            graphs, logits = capture_per_batch(
                self.device,
                self.batch_sizes,
                lambda bs, contexts=contexts: self.model.compute_logits(self.model(contexts[bs], self.layer_states)),
                pool=self.pool,
            )
            self.graphs.update({(bs, with_lora): g for bs, g in graphs.items()})
            self.logits.update({(bs, with_lora): out for bs, out in logits.items()})
        log.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def can_run(self, plan: PassPlan) -> bool:
        n = plan.num_rows
        return (
            0 < n <= self.max_batch
            and plan.num_decode_rows == n
            and plan.num_tokens == n
            and not plan.prompt_logprob_rows.any()
            and plan.block_tables.shape[1] <= self.max_pages
        )

    def run(self, plan: PassPlan, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab] of a decode-only plan. `prev_tokens`: the previous pass's sampled ids on
        the device, for the rows the plan marks in `input_from_prev`."""
        n = plan.num_rows
        bs = next(b for b in self.batch_sizes if b >= n)
        pages = plan.block_tables.shape[1]
        h, host_tables, turn = self._staging_buffers(bs, pages)
        from_prev = plan.input_from_prev if prev_tokens is not None else None
        host = h.numpy()  # numpy assignment copies from the plan's read-only wire buffers
        for row, values in (
            (_IDS, plan.input_ids),
            (_POS, plan.positions),
            (_SLOT, plan.slot_mapping),
            (_LEN, plan.seq_lens),
            (_STATE, plan.state_slots),
            (_PREV, from_prev if from_prev is not None else -1),
            (_LORA, plan.lora_slots if plan.lora_slots is not None else -1),
        ):
            host[row, :n] = values
        self._stage_padding(h, n)
        staged = host_tables[: n * pages].view(n, pages)
        staged.numpy()[:] = plan.block_tables
        self._upload(h, bs)
        self.block_tables[:n, :pages].copy_(staged, non_blocking=True)
        self._staged[turn].record()
        if bs > n:
            self.block_tables[n:bs, 0] = self.scratch_page
        if from_prev is not None:
            ids, src = self.fields[_IDS, :bs], self.fields[_PREV, :bs]
            ids.copy_(torch.where(src >= 0, prev_tokens.index_select(0, src.clamp(min=0)), ids))
        key = (bs, plan.lora_slots is not None and bool((plan.lora_slots >= 0).any()))
        self.graphs[key].replay()
        return self.logits[key][:n]


def capture_per_batch(
    device: torch.device,
    batch_sizes: tuple,
    step: Callable[[Any], Any],
    *,
    prepare: Callable[[Any], None] | None = None,
    pool=None,
) -> tuple[dict[Any, torch.cuda.CUDAGraph], dict[Any, Any]]:
    """A CUDA graph of `step(bs)` for each batch size (any sortable key), and the outputs each capture
    left (a replay rewrites them): largest first, so that later graphs reuse its memory pool; two runs
    before each capture, so that Triton compiles (and autotunes) outside it. prepare(bs): runs before
    them, outside the capture (fills the static buffers for that size). pool: a graph memory pool to
    share (None: a new one)."""
    graphs, outputs = {}, {}
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(stream):
        for bs in sorted(batch_sizes, reverse=True):
            if prepare is not None:
                prepare(bs)
            for _ in range(2):
                step(bs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[bs] = step(bs)
            graphs[bs] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs
