"""CUDA graphs for small prefill passes: a prefix-cache hit's new tokens, a short prompt, a chat turn.

An eager prefill pass is bound by the host (hundreds of kernel launches at tens of microseconds
each) once it has few tokens; such a pass replays one graph instead. A graph is captured per
(token bucket, rows, with captures, one fresh row) over static buffers; at run time the plan's arrays are staged
into those buffers and the pass is padded to its bucket with one more stream, the idle stream:
bucket + 1 - real tokens tokens (at least one, so that no stream is empty), on the reserved scratch
state slot without initial state, its KV written to the reserved scratch page (its block-table row
is all scratch page: it reads only what it wrote), ids 0. Its outputs are dropped.

Everything a kernel reads that depends on the plan is a device tensor; the host ints of the prefill
metadata are fixed at capture (max_query_len: the padded token count; max_seq_len: the block
table's span), and every prefill kernel sizes its grid from shapes and exits programs past their
stream's end. Prefix-cache captures (GDN snapshots inside or at the end of a row) go through
`FixedCaptures`: the same chunk-boundary stores and token replays as the eager path, from device
tensors, so a hit's usual captures (its prompt end and its last block boundary) stay in the graph.

Eligible: prefill rows only (1..max_rows), at most the largest bucket of tokens, no prompt logprobs,
no adapters, no speculative rows, at most CAPTURE_CAPACITY captures. Everything else runs eagerly.
`capture=False` runs the same static, padded forward eagerly (the CPU tests' way to check it).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deltaserve.layers.attention import sdpa_chunk
from deltaserve.layers.base import BatchedAttnMetadata, ForwardContext
from deltaserve.layers.kernels.gdn.fixed_captures import NUM_FIELDS, FixedCaptures, max_chunks
from deltaserve.layers.kernels.gdn.state import StateCapture, StateCaptures
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.model import HybridModel
from deltaserve.workers.cuda_graph import capture_per_batch
from deltaserve.workers.plan import PassPlan

log = logging.getLogger(__name__)

# up to 2k: on the H200 a 2k prompt's pass from its graph took 46.7-49.5 ms against 57.6-95.4 ms eagerly
# (the 35B shape, docs/PERF.md)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# captures a graphed pass may hold: a hit's prompt end and last block, a divergence, and a fresh 8k
# prompt's seven 1,024-token intervals with its last block and end (prefill_graph_max_tokens 8192);
# an entry a pass leaves unused costs a program that returns in each capture kernel
CAPTURE_CAPACITY = 16


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The default buckets up to max_tokens, and max_tokens itself (none for 0)."""
    if max_tokens <= 0:
        return ()
    return tuple(sorted({b for b in DEFAULT_TOKEN_BUCKETS if b < max_tokens} | {max_tokens}))


def prefill_graphs_fit(model: HybridModel) -> bool:
    """Whether a model's prefill passes can be graphed: its layers keep only KV pages and GDN state
    (Qwen4-Exp's QSA key caches and PLE state, and QSA's host-side choice by max_seq_len, stay eager)."""
    for layer in model.layers:
        names = layer.state_shapes(1) if layer.state_kind == "attention" else layer.state_shapes()
        if not set(names) <= {"k_cache", "v_cache", "recurrent", "conv"}:
            return False
    return True


class PrefillGraphs:
    def __init__(
        self,
        model: HybridModel,
        layer_states: list,
        *,
        max_pages: int,
        block_size: int,
        scratch_slot: int,
        scratch_page: int,
        buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS,
        max_rows: int = 1,
        with_captures: bool = True,
        device: torch.device,
        kernels: KernelOptions,
        capture: bool = True,
        graph_pool=None,
    ):
        """with_captures: also graphs for passes with prefix-cache captures (the pool has snapshot
        slots). capture: record CUDA graphs (else `run` runs the static forward eagerly).
        graph_pool: a CUDA graph memory pool to share (the decode graphs')."""
        self.model, self.layer_states, self.device = model, layer_states, torch.device(device)
        self.kernels = kernels  # the kernel choices every graph was captured with
        self.buckets = tuple(sorted(buckets))
        self.max_rows, self.with_captures = max_rows, with_captures
        self.max_pages, self.block_size = max_pages, block_size
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.replays = 0  # passes served (graph replays, or static eager runs without capture)
        tokens, streams = self.buckets[-1] + 1, max_rows + 1
        self._chunks = max_chunks(tokens, streams)
        # one int64 staging vector (a single H2D copy per pass): named views below
        sizes = dict(
            tokens=3 * tokens, cu=streams + 1, seq_lens=streams, slots=streams, init=streams, logits=max_rows,
            cap_fields=NUM_FIELDS * CAPTURE_CAPACITY, chunk_slots=self._chunks,
        )  # fmt: skip
        self._offsets, total = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (total, size)
            total += size
        cuda = self.device.type == "cuda"
        self._staging = [torch.zeros(total, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        # the idle stream of the largest bucket spans tokens / page pages, more than a plan's rows may hold
        # when the model's positions are fewer than a pass's tokens
        self.table_width = max(max_pages, -(-tokens // block_size))
        width = self.table_width
        self._staging_tables = [torch.zeros(streams * width, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._staged = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._turn = 0
        self.flat = torch.zeros(total, dtype=torch.int64, device=self.device)
        tok = self._view(self.flat, "tokens").view(3, tokens)
        self.input_ids, self.positions, self.slot_mapping = tok[0], tok[1], tok[2]
        self.state_slots = self._view(self.flat, "slots")
        self.logits_indices = self._view(self.flat, "logits")
        self.cap_fields = self._view(self.flat, "cap_fields").view(NUM_FIELDS, CAPTURE_CAPACITY)
        # the kernels' dtypes: converted from the staged int64 values on the device each pass
        self.cu_seqlens = torch.zeros(streams + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(streams, dtype=torch.int32, device=self.device)
        self.has_initial = torch.zeros(streams, dtype=torch.bool, device=self.device)
        self.chunk_slots = torch.full((self._chunks,), -1, dtype=torch.int32, device=self.device)
        self.block_tables = torch.full((streams, width), scratch_page, dtype=torch.int32, device=self.device)
        # one fresh row (no cached tokens) may attend by SDPA over all the bucket's tokens where the
        # kernel options would take SDPA for a chunk of that size (layers/attention.py): its own graphs
        self.fresh_buckets = {b for b in self.buckets if sdpa_chunk(kernels.prefill_attention, b + 1, b + 1)}
        self.keys = [
            (bucket, rows, caps, fresh)
            for bucket in self.buckets
            for rows in range(1, max_rows + 1)
            for caps in ((False, True) if with_captures else (False,))
            for fresh in ((False, True) if rows == 1 and bucket in self.fresh_buckets else (False,))
        ]
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        if capture:
            self._capture_all(graph_pool)
        else:  # the placeholders the capture stages, staged alike (host buffers sized for every key)
            for key in self.keys:
                self._stage(key, None)

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        start, size = self._offsets[name]
        return buf[start : start + size]

    def _context(self, key: tuple) -> ForwardContext:
        """The static context of a key's graph (a fresh FixedCaptures each call: its derived index
        tensors belong to one forward)."""
        bucket, rows, caps, fresh = key
        tokens, streams = bucket + 1, rows + 1
        prefill = BatchedAttnMetadata(
            positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            cu_seqlens=self.cu_seqlens[: streams + 1],
            block_tables=self.block_tables[:streams],
            seq_lens=self.seq_lens[:streams],
            state_slots=self.state_slots[:streams],
            has_initial_state=self.has_initial[:streams],
            max_query_len=tokens,
            max_seq_len=self.table_width * self.block_size,
            one_fresh_stream=fresh,
        )
        captures = None
        if caps:
            captures = FixedCaptures(self.chunk_slots[: max_chunks(tokens, streams)], self.cap_fields)
        return ForwardContext(
            config=self.model.config,
            layout=self.model.layout,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            decode=None,
            prefill=prefill,
            logits_indices=self.logits_indices[:rows],
            midchunk_capture=captures,
            kernels=self.kernels,
        )

    def _step(self, key: tuple) -> torch.Tensor:
        ctx = self._context(key)
        hidden = self.model(ctx, self.layer_states)
        return self.model.compute_logits(hidden[ctx.logits_indices])

    def _capture_all(self, graph_pool) -> None:
        # the warm-up runs and the capture of each key see one token a row, the rest idle, all on scratch
        graphs, logits = capture_per_batch(
            self.device, tuple(self.keys), self._step, prepare=lambda key: self._stage(key, None), pool=graph_pool
        )
        self.graphs.update(graphs)
        self.logits.update(logits)
        log.info("captured prefill CUDA graphs for token buckets %s (up to %d rows)", self.buckets, self.max_rows)

    def can_run(self, plan: PassPlan) -> bool:
        n, rows = plan.num_tokens, plan.num_rows
        captures = 0 if plan.captures is None else len(plan.captures)
        return (
            0 < rows <= self.max_rows
            and plan.num_decode_rows == 0
            and plan.num_spec_tokens == 0
            and rows <= n <= self.buckets[-1]
            and not plan.prompt_logprob_rows.any()
            and (plan.lora_slots is None or not (plan.lora_slots >= 0).any())
            and (plan.input_from_prev is None or not (plan.input_from_prev >= 0).any())
            and plan.block_tables.shape[1] <= self.max_pages
            and captures <= (CAPTURE_CAPACITY if self.with_captures else 0)
        )

    def _stage(self, key: tuple, plan: PassPlan | None, indices: np.ndarray | None = None) -> None:
        """Stage a pass (None: a placeholder of one token a row on scratch) into the static buffers."""
        bucket, rows, caps, _ = key
        tokens, page = bucket + 1, self.block_size
        turn = self._turn
        self._turn ^= 1
        if self._staged is not None and not self._staged[turn].query():  # a pass ago: in practice passed
            self._staged[turn].synchronize()
        h = self._staging[turn].numpy()
        tok = self._view(h, "tokens").reshape(3, -1)
        cu, seq_lens = self._view(h, "cu"), self._view(h, "seq_lens")
        slots, init, logits = self._view(h, "slots"), self._view(h, "init"), self._view(h, "logits")
        if plan is None:
            n = rows
            tok[:, :n] = 0
            tok[2, :n] = self.scratch_page * page
            cu[: rows + 1] = np.arange(rows + 1)
            seq_lens[:rows], slots[:rows], init[:rows] = 1, self.scratch_slot, 0
            logits[:] = np.arange(self.max_rows) % tokens
            table = np.full((rows, 1), self.scratch_page, dtype=np.int32)
        else:
            n = plan.num_tokens
            tok[0, :n], tok[1, :n], tok[2, :n] = plan.input_ids, plan.positions, plan.slot_mapping
            cu[: rows + 1] = plan.query_start_loc
            seq_lens[:rows], slots[:rows], init[:rows] = plan.seq_lens, plan.state_slots, plan.has_initial_state
            logits[: len(indices)] = indices
            logits[len(indices) :] = tokens - 1
            table = plan.block_tables
        idle = tokens - n  # the idle stream: positions 0.., its KV on the scratch page
        tok[0, n:tokens] = 0
        tok[1, n:tokens] = np.arange(idle)
        tok[2, n:tokens] = self.scratch_page * page + np.arange(idle) % page
        cu[rows + 1] = tokens
        seq_lens[rows], slots[rows], init[rows] = idle, self.scratch_slot, 0
        if caps:
            captures = None
            if plan is not None and plan.captures is not None and len(plan.captures):
                lens = tuple(int(x) for x in np.diff(plan.query_start_loc)) + (idle,)
                items = tuple(StateCapture(int(r), int(o), int(s)) for r, o, s in plan.captures)
                captures = StateCaptures(items, lens)
            fields = self._view(h, "cap_fields").reshape(NUM_FIELDS, CAPTURE_CAPACITY)
            chunk_slots = self._view(h, "chunk_slots")
            if not FixedCaptures.stage(fields, chunk_slots, captures, self.scratch_slot, rows):
                raise ValueError(f"more than {CAPTURE_CAPACITY} captures in a graphed pass")
        width = max(table.shape[1], -(-idle // page))
        staged = self._staging_tables[turn][: (rows + 1) * width].view(rows + 1, width)
        host_tables = staged.numpy()
        host_tables[:] = self.scratch_page
        host_tables[:rows, : table.shape[1]] = table
        self.flat.copy_(self._staging[turn], non_blocking=True)
        self.block_tables[: rows + 1, :width].copy_(staged, non_blocking=True)
        if self._staged is not None:
            self._staged[turn].record()
        streams = rows + 1
        self.cu_seqlens[: streams + 1].copy_(self._view(self.flat, "cu")[: streams + 1])
        self.seq_lens[:streams].copy_(self._view(self.flat, "seq_lens")[:streams])
        self.has_initial[:streams].copy_(self._view(self.flat, "init")[:streams])
        if caps:
            self.chunk_slots.copy_(self._view(self.flat, "chunk_slots"))

    def run(self, plan: PassPlan, indices: np.ndarray) -> torch.Tensor | None:
        """Logits [len(indices), vocab] of the plan's logits rows (`indices`: each sampling row's last
        token, context.logits_rows), None when there are none."""
        bucket = next(b for b in self.buckets if b >= plan.num_tokens)
        caps = plan.captures is not None and len(plan.captures) > 0
        fresh = bucket in self.fresh_buckets and plan.num_rows == 1 and int(plan.seq_lens[0]) == plan.num_tokens
        key = (bucket, plan.num_rows, caps, fresh)
        self._stage(key, plan, indices)
        self.replays += 1
        if key in self.graphs:
            self.graphs[key].replay()
            logits = self.logits[key]
        else:
            with torch.inference_mode():
                logits = self._step(key)
        return logits[: len(indices)] if len(indices) else None
