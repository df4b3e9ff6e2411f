"""Speculative decoding with the MTP head, on the worker: what follows a pass's target forward and
sampling in a speculative engine.

1. Write-on-accept: each verify row's GDN slots move to the state after its last accepted token
   (`HybridModel.write_on_accept`, from the verify tables the target pass recorded).
2. Catch-up: the head runs over every position of the pass with the target's hidden state there and
   the token after it (the next prompt token, or what was sampled: for a verify row, the sampled
   token at each of its positions, which equals the draft wherever the draft was accepted). Its KV
   then covers every position the target has computed. A verify row's positions past its accepted
   ones hold KV that later passes overwrite (they lie past the request's computed length).
3. Drafting: for each drafting row, the head's output at its last valid position (a verify row's
   accepted position, found on the device) gives the first draft; k - 1 single-token steps follow,
   each reading the previous step's output hidden and draft. Their KV goes to the lookahead positions
   the scheduler allocated pages for (also overwritten by the next catch-up).

Every TP rank runs all of it (the head's layer reduces across ranks; every rank samples the same
tokens). Shapes follow from the plan alone: the accepted counts never leave the device here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deltaserve.layers.base import ForwardContext
from deltaserve.layers.kernels import argmax as argmax_kernels
from deltaserve.layers.model import HybridModel
from deltaserve.workers.context import decode_context, upload
from deltaserve.workers.state_pool import StatePool


class SpecDecoder:
    def __init__(self, model: HybridModel, pool: StatePool, num_spec_tokens: int):
        if model.mtp is None or pool.mtp_state is None:
            raise ValueError("speculative decoding needs the model's MTP head and its KV in the pool")
        self.model, self.pool, self.k = model, pool, num_spec_tokens

    def after_sampling(
        self,
        plan,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        verify_sampled: torch.Tensor | None,
        num_accepted: torch.Tensor | None,
        row_tokens: torch.Tensor | None,
        row_token_index: list[int],
    ) -> torch.Tensor | None:
        """Write-on-accept, the head's catch-up over the pass and the drafts of the drafting rows.

        plan: the PassPlan (its verify rows come first when plan.num_spec_tokens > 0); hidden [T, H]:
        the target's final hidden states; verify_sampled [Nv, k + 1] and num_accepted [Nv]: the
        verify rows' sampled tokens and accepted counts; row_tokens: the other sampling rows'
        tokens, row_token_index[n] the entry of plan row n in it (-1: the row did not sample there).
        Returns the drafts [R, k] of the plan's drafting rows, in row order (None: none)."""
        nv = plan.num_decode_rows if plan.num_spec_tokens else 0
        with torch.inference_mode():
            if nv:
                self.model.write_on_accept(
                    self.pool.layer_states, ctx.decode.state_slots, num_accepted, stack=self.pool.verify_stack
                )
            ids_next = self._next_tokens(plan, ctx, nv, verify_sampled, row_tokens, row_token_index)
            catch_up = dataclasses.replace(ctx, input_ids=ids_next, midchunk_capture=None)
            out = self.model.mtp_forward(catch_up, hidden, self.pool.mtp_state)
            drafting = np.flatnonzero(plan.draft_rows) if plan.draft_rows is not None else np.zeros(0, np.int64)
            if not len(drafting):
                return None
            return self._draft(plan, ctx, out, drafting, nv, num_accepted)

    def _next_tokens(self, plan, ctx, nv, verify_sampled, row_tokens, row_token_index) -> torch.Tensor:
        """Each pass position's next token, on the device: the next input within a row; at a row's
        last position the token sampled there, or the next prompt token (a chunk that does not end
        its prompt). A plan of verify rows only needs nothing from the host (CUDA graphs capture it)."""
        ids = ctx.input_ids
        starts = plan.query_start_loc
        if nv and plan.num_rows == nv:  # verify rows only: what they sampled, position by position
            return verify_sampled.reshape(-1).to(ids.dtype)
        ids_next = torch.empty_like(ids)
        ids_next[:-1] = ids[1:]
        if nv:
            ids_next[: int(starts[nv])] = verify_sampled.reshape(-1).to(ids.dtype)
        rows = np.arange(nv, plan.num_rows)
        last = starts[rows + 1] - 1
        src = np.asarray(row_token_index, dtype=np.int64)[rows]
        sampled = src >= 0
        prompt_next = np.maximum(plan.next_prompt_token[rows][~sampled], 0)  # -1 only where nothing follows
        prompt_at, prompt_ids, sample_at, sample_src = upload(
            [last[~sampled], prompt_next, last[sampled], src[sampled]], ids.device
        )
        if prompt_at.numel():
            ids_next.index_copy_(0, prompt_at, prompt_ids.to(ids.dtype))
        if sample_at.numel():
            ids_next.index_copy_(0, sample_at, row_tokens.index_select(0, sample_src).to(ids.dtype))
        return ids_next

    def _draft(self, plan, ctx, out, drafting, nv, num_accepted) -> torch.Tensor:
        """k drafts for each drafting row: the first from the catch-up's output at the row's last
        valid position, then k - 1 single-token steps of the head."""
        model, starts, length = self.model, plan.query_start_loc, plan.num_spec_tokens + 1
        # every verify row drafts (its request speculates); their catch-up row is the accepted one
        others = drafting[drafting >= nv]
        tables = [m.block_tables for m in (ctx.decode, ctx.prefill) if m is not None]
        if len(others):
            rows = np.concatenate([np.arange(nv) * length, starts[others + 1] - 1])
            base, bt_rows = upload([rows, drafting], out.device)
            # the decode and prefill rows' block tables are views of one [N, max_pages] upload
            block_tables = (tables[0] if len(tables) == 1 else torch.cat(tables)).index_select(0, bt_rows)
            if nv:
                base[:nv] += num_accepted
        else:  # verify rows only: device work alone (CUDA graphs capture it); row_starts is a shared buffer
            base, block_tables = ctx.decode.row_starts()[:nv] + num_accepted, ctx.decode.block_tables
        hidden = out.index_select(0, base)
        drafts = [argmax_kernels.row_argmax(logits=model.compute_logits(hidden), pdl=ctx.kernels.pdl)]
        if self.k == 1:
            return drafts[0][:, None]
        # every draft step's positions, KV slots and lengths at once ([k - 1, R]: a step's row contiguous)
        block_size = self.pool.sizes.block_size
        steps = torch.arange(1, self.k, device=out.device, dtype=torch.int64)[:, None]
        positions = ctx.positions.index_select(0, base).to(torch.int64)[None, :] + steps
        pages = block_tables.t().gather(0, positions // block_size).to(torch.int64)
        slots = pages * block_size + positions % block_size
        seq_lens = (positions + 1).to(torch.int32)
        state_slots = torch.zeros(len(drafting), dtype=torch.int32, device=out.device)
        for i in range(self.k - 1):
            step = decode_context(
                config=ctx.config,
                layout=ctx.layout,
                kernels=ctx.kernels,
                input_ids=drafts[-1],
                positions=positions[i],
                slot_mapping=slots[i],
                block_tables=block_tables,
                seq_lens=seq_lens[i],
                state_slots=state_slots,
            )
            hidden = model.mtp_forward(step, hidden, self.pool.mtp_state)
            drafts.append(argmax_kernels.row_argmax(logits=model.compute_logits(hidden), pdl=ctx.kernels.pdl))
        return torch.stack(drafts, dim=1)
