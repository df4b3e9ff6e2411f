"""Hand-built pass plans for model-level tests (the engine's scheduler builds them for real).

`Sequences` hands out pages in a scrambled order and one state slot per sequence, so that block
tables are not the identity and sequences share the pools.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.model import HybridModel
from deltaserve.workers.context import build_forward_context, logits_rows
from deltaserve.workers.plan import PassPlan, PoolSizes
from deltaserve.workers.state_pool import StatePool


class Sequences:
    def __init__(
        self,
        model: HybridModel,
        num_blocks: int = 64,
        block_size: int = 4,
        num_slots: int = 8,
        kernels: KernelOptions | None = None,
        lora=None,
        kv_dtype: torch.dtype | None = None,
    ):
        """lora: the model's AdapterSlots (workers/lora.py) when sequences run on adapters; kv_dtype:
        the KV pages' dtype (float8_e4m3fn: an FP8 KV cache)."""
        self.model = model
        self.lora = lora
        self.lora_slot: dict[str, int] = {}
        self.kernels = kernels or KernelOptions()
        self.block_size = block_size
        sizes = PoolSizes(num_blocks, block_size, num_slots)
        self.pool = StatePool(model, sizes, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)
        rng = np.random.default_rng(0)
        self.free_pages = list(rng.permutation(num_blocks))
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pages: dict[str, list[int]] = {}
        self.slot: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.pass_id = 0
        # fill the pools with garbage: a sequence must never read state it did not write
        for state in self.pool.layer_states:
            for t in vars(state).values():
                if isinstance(t, torch.Tensor):
                    t.copy_(torch.randn(t.shape))

    def add(self, seq: str, lora_slot: int = -1) -> None:
        self.pages[seq], self.slot[seq], self.cached[seq] = [], self.free_slots.pop(), 0
        self.lora_slot[seq] = lora_slot

    def run(
        self, rows: list[tuple[str, list[int]]], tokens_per_row: int = 1, verify: bool = False
    ) -> list[torch.Tensor]:
        """One pass over rows (seq, new token ids); rows of `tokens_per_row` tokens of cached
        sequences go first as decode rows (more than one: speculative-verify rows); verify: every
        row is a decode row of the same token count. Returns each row's logits for all its new
        tokens, in the order given; `self.last` keeps the pass's (context, hidden states, rows in
        pass order) for `mtp`."""
        decode = [r for r in rows if len(r[1]) == tokens_per_row and self.cached[r[0]] > 0]
        if verify:
            decode = list(rows)
        prefill = [r for r in rows if r not in decode]
        ordered = decode + prefill
        ids, pos, slots, starts, seq_lens, tables, state_slots, has_init = [], [], [], [0], [], [], [], []
        for seq, toks in ordered:
            start = self.cached[seq]
            end = start + len(toks)
            while len(self.pages[seq]) * self.block_size < end:
                self.pages[seq].append(int(self.free_pages.pop()))
            for p in range(start, end):
                slots.append(self.pages[seq][p // self.block_size] * self.block_size + p % self.block_size)
            ids += toks
            pos += list(range(start, end))
            starts.append(starts[-1] + len(toks))
            seq_lens.append(end)
            tables.append(self.pages[seq])
            state_slots.append(self.slot[seq])
            has_init.append(start > 0)
            self.cached[seq] = end
        width = max(len(t) for t in tables)
        n = len(ordered)
        plan = PassPlan(
            pass_id=self.pass_id,
            req_ids=[s for s, _ in ordered],
            num_decode_rows=len(decode),
            input_ids=np.array(ids, np.int32),
            positions=np.array(pos, np.int32),
            slot_mapping=np.array(slots, np.int64),
            query_start_loc=np.array(starts, np.int32),
            seq_lens=np.array(seq_lens, np.int32),
            block_tables=np.array([t + [0] * (width - len(t)) for t in tables], np.int32),
            state_slots=np.array(state_slots, np.int32),
            has_initial_state=np.array(has_init, bool),
            sample_rows=np.ones(n, bool),
            prompt_logprob_rows=np.ones(n, bool),
            lora_slots=np.array([self.lora_slot[s] for s, _ in ordered], np.int32) if self.lora else None,
        )
        self.pass_id += 1
        indices, spans = logits_rows(plan)
        lora = {}
        if self.lora is not None:
            lora = dict(num_lora_slots=self.lora.num_slots, moe_lora_route=self.lora.route(plan.lora_slots))
        ctx = build_forward_context(
            plan, self.model.config, self.model.layout, "cpu", indices, kernels=self.kernels, **lora
        )
        with torch.no_grad():
            hidden = self.model(ctx, self.pool.layer_states)
            logits = self.model.compute_logits(hidden[ctx.logits_indices])
        self.last = (ctx, hidden, [seq for seq, _ in ordered])
        by_seq = {
            seq: logits[first : first + count] for (seq, _), (first, count, _) in zip(ordered, spans, strict=True)
        }
        return [by_seq[seq] for seq, _ in rows]

    def mtp(self, next_ids: dict[str, list[int]], hidden: dict[str, torch.Tensor] | None = None) -> dict:
        """The MTP head over the last pass's rows: each row's token ids shifted by one (next_ids[seq]
        for each of its positions) with the target's hidden states of that pass, or `hidden[seq]`
        instead. Returns seq -> (logits, the head's output hidden) for each of its positions."""
        ctx, target_hidden, order = self.last
        ids = torch.tensor([t for seq in order for t in next_ids[seq]])
        assert ids.shape[0] == ctx.num_tokens
        if hidden is not None:
            target_hidden = torch.cat([hidden[seq] for seq in order])
        with torch.no_grad():
            out = self.model.mtp_forward(dataclasses.replace(ctx, input_ids=ids), target_hidden, self.pool.mtp_state)
            logits = self.model.compute_logits(out)
        result, start = {}, 0
        for seq in order:
            n = len(next_ids[seq])
            result[seq] = (logits[start : start + n], out[start : start + n])
            start += n
        return result
