"""Qwen4-Exp attention: Qwen3 gated attention whose queries each attend to a QSA selection of the
sequence (transformers' Qwen4ExpTextAttention + Qwen4ExpTextQSAIndexer).

The indexer projects the layer input to `num_heads` query heads and one key head of `head_dim`.
Queries get the zero-centred q_layernorm and rotary embedding at their position. Raw keys go into
a paged cache beside the KV pages; when a token completes a block of `compress_ratio` tokens, the
block's keys are averaged, normed (k_layernorm) and rotated at the block's first position into the
compressed-key cache (kernels/qsa/naive.py has the layouts). Those two paged caches are the seed's
`AttnLayerState.indexer_carry` (`QsaCache`): per sequence through its block table, updated as tokens
arrive and blocks complete, shared with the KV pages by prefix caching and copied with them.

Each query scores the complete blocks before it, keeps the top budget / compress_ratio and attends
(gated attention as in attention.py) to their tokens and to its incomplete block's tokens. While no
query of a group can have more complete blocks than it keeps, the selection is everything: the
dense paged kernels run instead.

Tensor parallel: the attention heads split as in GatedAttention; every rank runs the whole indexer
(one key head) on the same input, so the selections agree across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import GatedAttention, join_rows
from .base import AttnLayerState, CheckpointTensor, ForwardContext
from .common import empty_param, project, whole
from .config import ModelConfig
from .kernels import attention as attn_kernels
from .kernels import qsa as qsa_kernels
from .kernels import rotary as rotary_kernels
from .kernels.options import KernelOptions
from .parallel import ParallelLayout, all_reduce
from .pass_rows import PassRows


@dataclass
class QsaCache:
    """The QSA indexer's carry of one layer: keys [num_blocks, block_size, D] (raw, per token) and
    blocks [num_blocks, (block_size - 1) // r + 1, D] (compressed, per complete block)."""

    keys: torch.Tensor
    blocks: torch.Tensor


@dataclass
class _Group:
    """One group of a pass's tokens (the decode rows or the prefill chunk) as the indexer needs it."""

    tokens: slice
    rows: torch.Tensor  # [T_group] row of block_tables
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor  # [N + 1] query starts within the group
    max_seq_len: int  # host bound on the group's sequence lengths
    decode_rows: int  # > 0: one-token decode rows (the fused-gate decode kernel applies)


class QsaAttention(GatedAttention):
    def __init__(self, config: ModelConfig, layout: ParallelLayout):
        super().__init__(config, layout)
        self.qsa = qsa = config.qsa
        self.index_q_size = qsa.num_heads * qsa.head_dim
        self.index_proj = empty_param(self.index_q_size + qsa.head_dim, config.hidden_size)  # [q heads | key]
        self.index_q_norm = empty_param(qsa.head_dim)
        self.index_k_norm = empty_param(qsa.head_dim)

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        return [
            *super().checkpoint_tensors(prefix),
            whole(f"{prefix}indexer.index_qk_proj.weight", self.index_proj),
            whole(f"{prefix}indexer.q_layernorm.weight", self.index_q_norm, init="zeros"),
            whole(f"{prefix}indexer.k_layernorm.weight", self.index_k_norm, init="zeros"),
        ]

    def state_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        d, r = self.qsa.head_dim, self.qsa.compress_ratio
        return {
            **super().state_shapes(block_size),
            "index_keys": (block_size, d),
            "index_blocks": ((block_size - 1) // r + 1, d),
        }

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: AttnLayerState, rows: PassRows) -> torch.Tensor:
        qkv = project(x, self.qkv_proj, ctx.kernels, self.in_proj_bias)
        return self.mix_sparse(qkv, project(x, self.index_proj, ctx.kernels), ctx, state, rows)

    def mix_sparse(
        self, qkv: torch.Tensor, index_qk: torch.Tensor, ctx: ForwardContext, state: AttnLayerState, rows: PassRows
    ) -> torch.Tensor:
        """qkv [T, q_gate | k | v], index_qk [T, index q | index key] -> [T, hidden] (reduced over TP ranks)."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q, gate, _ = self.queries_and_cache(qkv, ctx, state)
        carry: QsaCache = state.indexer_carry
        iq, raw_key = self._index_inputs(index_qk, ctx)
        qsa_kernels.write_index_keys(keys=raw_key, key_cache=carry.keys, slot_mapping=ctx.slot_mapping)
        outs = []
        for group in self._groups(ctx, rows, state.k_cache.shape[1]):
            sl = group.tokens
            positions = ctx.positions[sl]
            qsa_kernels.compress_blocks(
                key_cache=carry.keys,
                block_cache=carry.blocks,
                positions=positions,
                slot_mapping=ctx.slot_mapping[sl],
                token_rows=group.rows,
                block_tables=group.block_tables,
                norm_weight=self.index_k_norm,
                eps=self.eps,
                rotary_dim=self.rotary_dim,
                theta=self.rope_theta,
                compress_ratio=self.qsa.compress_ratio,
            )
            outs.append(self._attend(q[sl], gate[sl], iq[sl], positions, group, state, ctx.kernels))
        out = join_rows(*outs) if len(outs) == 2 else outs[0]
        out = project(
            out.reshape(num_tokens, self.num_heads * d), self.o_proj, ctx.kernels, self.o_bias if self.bias else None
        )
        return all_reduce(out, self.layout)

    def _index_inputs(self, index_qk: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, rotated indexer queries [T, Hi, D], raw indexer keys [T, D])."""
        num_tokens, d = index_qk.shape[0], self.qsa.head_dim
        raw_key = index_qk[:, self.index_q_size :]
        iq, _ = rotary_kernels.qk_norm_rope(  # the key head's result is unused: keys are normed per block
            q=index_qk[:, : self.index_q_size].view(num_tokens, self.qsa.num_heads, d),
            k=raw_key.view(num_tokens, 1, d),
            q_weight=self.index_q_norm,
            k_weight=self.index_k_norm,
            positions=ctx.positions,
            eps=self.eps,
            rotary_dim=self.rotary_dim,
            theta=self.rope_theta,
            pdl=ctx.kernels.pdl,
        )
        return iq, raw_key

    def _groups(self, ctx: ForwardContext, rows: PassRows, block_size: int) -> list[_Group]:
        groups = []
        nd = rows.num_decode_tokens
        if ctx.decode is not None:
            dec = ctx.decode
            step = dec.tokens_per_row
            groups.append(
                _Group(
                    tokens=slice(0, nd),
                    rows=rows.token_rows[:nd],
                    block_tables=dec.block_tables,
                    seq_lens=dec.seq_lens,
                    cu_seqlens=torch.arange(0, nd + 1, step, dtype=torch.int32, device=dec.seq_lens.device),
                    max_seq_len=dec.block_tables.shape[1] * block_size,
                    decode_rows=dec.num_seqs if dec.tokens_per_row == 1 else 0,
                )
            )
        if ctx.prefill is not None:
            pre = ctx.prefill
            groups.append(
                _Group(
                    tokens=slice(nd, None),
                    rows=rows.token_rows[nd:] - rows.num_decode_rows,
                    block_tables=pre.block_tables,
                    seq_lens=pre.seq_lens,
                    cu_seqlens=pre.cu_seqlens,
                    max_seq_len=pre.max_seq_len,
                    decode_rows=0,
                )
            )
        return groups

    def _attend(
        self,
        q: torch.Tensor,
        gate: torch.Tensor,
        iq: torch.Tensor,
        positions: torch.Tensor,
        group: _Group,
        state: AttnLayerState,
        kernels: KernelOptions,
    ) -> torch.Tensor:
        """The group's gated attention output [T_group, H, D]."""
        r, top = self.qsa.compress_ratio, self.qsa.top_blocks
        carry: QsaCache = state.indexer_carry
        block_size = state.k_cache.shape[1]
        if group.max_seq_len < (top + 1) * r:  # no query has more complete blocks than it keeps
            if group.decode_rows:
                return attn_kernels.paged_decode_attention(
                    q=q,
                    k_cache=state.k_cache,
                    v_cache=state.v_cache,
                    seq_lens=group.seq_lens,
                    block_tables=group.block_tables,
                    scale=self.scale,
                    output_gate=gate,
                    pdl=kernels.pdl,
                )
            return attn_kernels.paged_attention(
                q=q,
                k_cache=state.k_cache,
                v_cache=state.v_cache,
                cu_seqlens_q=group.cu_seqlens,
                seq_lens=group.seq_lens,
                block_tables=group.block_tables,
                scale=self.scale,
                output_gate=gate,
            )
        scores = qsa_kernels.index_scores(
            q=iq,
            block_cache=carry.blocks,
            positions=positions,
            token_rows=group.rows,
            block_tables=group.block_tables,
            compress_ratio=r,
            block_size=block_size,
            max_blocks=group.max_seq_len // r,
        )
        selected = qsa_kernels.block_topk(scores=scores, positions=positions, compress_ratio=r, top_blocks=top)
        out = qsa_kernels.sparse_attention(
            q=q,
            k_cache=state.k_cache,
            v_cache=state.v_cache,
            positions=positions,
            token_rows=group.rows,
            block_tables=group.block_tables,
            selected=selected,
            compress_ratio=r,
            scale=self.scale,
        )
        return out * torch.sigmoid(gate)
