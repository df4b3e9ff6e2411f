"""CUDA graphs for speculative steps: a pass whose rows are all verify rows of greedy requests (no
logprobs) is captured once per batch size, the whole step in one graph: the target over k + 1 tokens
a row, the logits' argmax, the accepted counts, write-on-accept, the MTP head's catch-up and its
k - 1 draft steps. Every index it uses is computed on the device (workers/spec_decode.py), so the
replay needs only the plan's arrays in static buffers.

Padding rows write no target KV (slot -1), verify on the reserved scratch slot and draft on the
reserved scratch page (their block-table row is all scratch page), so they touch no request's state.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deltaserve.layers.base import ForwardContext
from deltaserve.layers.kernels import argmax as argmax_kernels
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.model import HybridModel
from deltaserve.workers.context import decode_context, upload
from deltaserve.workers.cuda_graph import capture_per_batch
from deltaserve.workers.plan import PassPlan
from deltaserve.workers.rejection import accept_drafts
from deltaserve.workers.spec_decode import SpecDecoder

log = logging.getLogger(__name__)

# target tokens (rows x (k + 1)) of the largest verify step captured: batch 64 up to k = 7 (the
# verify's logits, [tokens, vocab], live in the graphs' pool)
MAX_GRAPH_TOKENS = 512


class VerifyGraphs:
    def __init__(
        self,
        model: HybridModel,
        spec: SpecDecoder,
        *,
        max_pages: int,
        scratch_slot: int,
        scratch_page: int,
        batch_sizes: tuple[int, ...],
        device: torch.device,
        kernels: KernelOptions,
    ):
        self.model, self.spec, self.device = model, spec, device
        self.kernels = kernels  # the kernel choices every graph was captured with
        self.k, self.length = spec.k, spec.k + 1
        self.batch_sizes = tuple(sorted(b for b in batch_sizes if b * self.length <= MAX_GRAPH_TOKENS))
        self.max_pages, self.scratch_slot, self.scratch_page = max_pages, scratch_slot, scratch_page
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if not self.batch_sizes:
            return
        n, length = self.batch_sizes[-1], self.length
        self.ids = torch.zeros(n * length, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n * length, dtype=torch.int64, device=device)
        self.slots = torch.full((n * length,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), length, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, max_pages), scratch_page, dtype=torch.int32, device=device)
        self._capture_all()

    def _context(self, bs: int) -> ForwardContext:
        t = bs * self.length
        return decode_context(
            config=self.model.config,
            layout=self.model.layout,
            kernels=self.kernels,
            input_ids=self.ids[:t],
            positions=self.positions[:t],
            slot_mapping=self.slots[:t],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            state_slots=self.state_slots[:bs],
            tokens_per_row=self.length,
        )

    def _template(self, bs: int) -> PassPlan:
        """The host-side shape of a captured step (spec_decode reads its row layout)."""
        t, zeros = bs * self.length, np.zeros(bs, np.int32)
        return PassPlan(
            pass_id=-1,
            req_ids=[""] * bs,
            num_decode_rows=bs,
            input_ids=np.zeros(t, np.int32),
            positions=np.zeros(t, np.int32),
            slot_mapping=np.zeros(t, np.int64),
            query_start_loc=np.arange(0, t + 1, self.length, dtype=np.int32),
            seq_lens=zeros,
            block_tables=np.zeros((bs, 1), np.int32),
            state_slots=zeros,
            has_initial_state=np.ones(bs, bool),
            sample_rows=np.ones(bs, bool),
            prompt_logprob_rows=np.zeros(bs, bool),
            next_prompt_token=np.full(bs, -1, np.int32),
            num_spec_tokens=self.k,
            draft_rows=np.ones(bs, bool),
        )

    def _step(self, ctx: ForwardContext, template: PassPlan):
        bs, model = template.num_rows, self.model
        hidden = model(ctx, self.spec.pool.layer_states)
        logits = model.compute_logits(hidden)
        sampled = argmax_kernels.row_argmax(logits=logits, pdl=self.kernels.pdl).view(bs, self.length)
        accepted = accept_drafts(sampled, ctx.input_ids.view(bs, self.length)[:, 1:])
        drafts = self.spec.after_sampling(template, ctx, hidden, sampled, accepted, None, [-1] * bs)
        return sampled, accepted, drafts

    def _capture_all(self) -> None:
        shapes = {bs: (self._context(bs), self._template(bs)) for bs in self.batch_sizes}
        self.graphs, self.out = capture_per_batch(self.device, self.batch_sizes, lambda bs: self._step(*shapes[bs]))
        log.info("captured speculative verify CUDA graphs (k = %d) for batch sizes %s", self.k, self.batch_sizes)

    def can_run(self, plan: PassPlan) -> bool:
        n = plan.num_rows
        return (
            bool(self.batch_sizes)
            and 0 < n <= self.batch_sizes[-1]
            and plan.num_spec_tokens == self.k
            and plan.num_decode_rows == n
            and plan.draft_rows is not None
            and bool(plan.draft_rows.all())
            and not plan.prompt_logprob_rows.any()
            and plan.block_tables.shape[1] <= self.max_pages
        )

    def run(self, plan: PassPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sampled [N, k + 1], accepted counts [N], drafts [N, k]) of a plan `can_run` accepts, on
        the device (views of the graph's outputs: read them before the next replay)."""
        n, length = plan.num_rows, self.length
        bs = next(b for b in self.batch_sizes if b >= n)
        pad = bs - n
        pages = plan.block_tables.shape[1]
        tables = np.full((bs, self.max_pages), self.scratch_page, np.int64)
        tables[:n, :pages] = plan.block_tables
        ids, positions, slots, seq_lens, state_slots, block_tables = upload(
            [
                np.concatenate([plan.input_ids, np.zeros(pad * length, np.int64)]),
                np.concatenate([plan.positions, np.tile(np.arange(length), pad)]),
                np.concatenate([plan.slot_mapping, np.full(pad * length, -1, np.int64)]),
                np.concatenate([plan.seq_lens, np.full(pad, length, np.int64)]),
                np.concatenate([plan.state_slots, np.full(pad, self.scratch_slot, np.int64)]),
                tables,
            ],
            self.device,
        )
        t = bs * length
        self.ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(slots)
        self.seq_lens[:bs].copy_(seq_lens)
        self.state_slots[:bs].copy_(state_slots)
        self.block_tables[:bs].copy_(block_tables)
        self.graphs[bs].replay()
        sampled, accepted, drafts = self.out[bs]
        return sampled[:n], accepted[:n], drafts[:n]
