"""Qwen3 gated full attention over a paged KV cache.

q_proj produces, per head, the query and a same-sized output gate; q and k get a zero-centred
RMSNorm over the head dim and rotary embeddings on the first `rotary_dim` features; the attention
output is multiplied by sigmoid(gate) before o_proj. Grouped-query attention: q head h reads kv
head h // (num_heads // num_kv_heads).

q_proj, k_proj and v_proj load into one fused local weight whose rows are [q_gate | k | v] (this
rank's heads of each), so the input projection is one GEMM; q, gate, k and v are views of its output.

Tensor parallel: q heads split; kv heads split, or replicated when TP exceeds them; o_proj is
row-parallel with one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import AttnLayerState, CheckpointTensor, ForwardContext
from .common import RMSNorm, col_range, empty_param, project, row_ranges
from .config import ModelConfig
from .kernels import attention as attn_kernels
from .kernels import rotary as rotary_kernels
from .kernels.low_rank import PairLowRank
from .lora import NO_SLOTS, LoraTarget, add_lora, column_target, out_lora, row_target
from .parallel import ParallelLayout
from .quant import Fp8Projection

# prefill_attention "auto": SDPA (flash) for a chunk of one sequence with at least this many queries
# and at most SDPA_MAX_KEYS keys (its keys and values expanded to the q heads: 537 MB at 32k on the
# 35B shape, transient). One H200, 35B shape (41b3549, `bench offline --variants
# "base:;sdpa:prefill_attention=sdpa"`): 8k prompt 141.7 -> 136.5 ms, 32k (chunks of 8k after cached
# ones) 738.3 -> 615.1 ms; at 2k (eager, host-bound) no gain measured
SDPA_MIN_QUERIES = 4096
SDPA_MAX_KEYS = 32768


def sdpa_chunk(mode: str, max_query_len: int, max_seq_len: int) -> bool:
    """Whether a one-sequence prefill chunk of these sizes takes SDPA under `prefill_attention`
    mode (a prefill graph's one fresh stream too, its padding counted: "auto" from graphs of
    SDPA_MIN_QUERIES tokens, prefill_graph_max_tokens 4,096 or more)."""
    return mode == "sdpa" or (mode == "auto" and max_query_len >= SDPA_MIN_QUERIES and max_seq_len <= SDPA_MAX_KEYS)


class GatedAttention(nn.Module):
    lora_slots = NO_SLOTS  # adapter slots of "in" (q | k | v) and "out" (o_proj), once enabled (layers/lora.py)

    def __init__(self, config: ModelConfig, layout: ParallelLayout):
        super().__init__()
        self.layout = layout
        self.head_dim = d = config.head_dim
        self.hidden_size = h = config.hidden_size
        self.total_heads, self.total_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_start, self.num_heads = layout.split(config.num_attention_heads, "num_attention_heads")
        self.kv_head_start, self.num_kv_heads = layout.kv_heads(config.num_kv_heads, config.num_attention_heads)
        self.scale = d**-0.5
        # fused input projection, rows [q_gate | k | v]; per q head: query rows, then gate rows
        self.q_size, self.kv_size = self.num_heads * 2 * d, self.num_kv_heads * d
        self.qkv_proj = empty_param(self.q_size + 2 * self.kv_size, h)
        self.o_proj = empty_param(h, self.num_heads * d)
        self.bias = config.attention_bias
        if self.bias:
            self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size)
            self.o_bias = empty_param(h)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary_dim, self.rope_theta, self.eps = config.rotary_dim, config.rope_theta, config.rms_norm_eps

    def _qkv_rows(self) -> tuple[tuple, tuple, tuple, tuple, tuple]:
        """(checkpoint row start, fused row start, rows) of this rank's q, k and v, and the checkpoint
        shapes of q_proj and of k_proj / v_proj."""
        d, h, qs, kvs = self.head_dim, self.hidden_size, self.q_size, self.kv_size
        q_rows = (self.head_start * 2 * d, 0, qs)
        k_rows = (self.kv_head_start * d, qs, kvs)
        v_rows = (self.kv_head_start * d, qs + kvs, kvs)
        return q_rows, k_rows, v_rows, (self.total_heads * 2 * d, h), (self.total_kv_heads * d, h)

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        d, h = self.head_dim, self.hidden_size
        q_rows, k_rows, v_rows, q_shape, kv_shape = self._qkv_rows()
        out = [
            row_ranges(f"{prefix}q_proj.weight", self.qkv_proj, q_shape, [q_rows]),
            row_ranges(f"{prefix}k_proj.weight", self.qkv_proj, kv_shape, [k_rows]),
            row_ranges(f"{prefix}v_proj.weight", self.qkv_proj, kv_shape, [v_rows]),
            col_range(f"{prefix}o_proj.weight", self.o_proj, (h, self.total_heads * d), self.head_start * d),
            *self.q_norm.checkpoint_tensors(f"{prefix}q_norm.weight"),
            *self.k_norm.checkpoint_tensors(f"{prefix}k_norm.weight"),
        ]
        if self.bias:
            out += [
                row_ranges(f"{prefix}q_proj.bias", self.qkv_bias, q_shape[:1], [q_rows], init="zeros"),
                row_ranges(f"{prefix}k_proj.bias", self.qkv_bias, kv_shape[:1], [k_rows], init="zeros"),
                row_ranges(f"{prefix}v_proj.bias", self.qkv_bias, kv_shape[:1], [v_rows], init="zeros"),
                # the o_proj bias is added once, after the all-reduce, by rank 0's share
                _rank0_bias(f"{prefix}o_proj.bias", self.o_bias, self.layout),
            ]
        return out

    def fp8_projections(self, prefix: str) -> list[Fp8Projection]:
        """q_gate | k | v (pieces of whole heads) and o_proj (a rank's columns start on a head)."""
        qkv = tuple(f"{prefix}{p}_proj" for p in "qkv")
        return [
            Fp8Projection(self, "qkv_proj", qkv, row_unit=self.head_dim, col_unit=0),
            Fp8Projection(self, "o_proj", (f"{prefix}o_proj",), row_unit=0, col_unit=self.head_dim),
        ]

    def lora_targets(self, prefix: str) -> list[LoraTarget]:
        q_rows, k_rows, v_rows, q_shape, kv_shape = self._qkv_rows()
        d = self.head_dim
        return [
            column_target(f"{prefix}q_proj", self, "in", q_shape, [q_rows]),
            column_target(f"{prefix}k_proj", self, "in", kv_shape, [k_rows]),
            column_target(f"{prefix}v_proj", self, "in", kv_shape, [v_rows]),
            row_target(f"{prefix}o_proj", self, "out", (self.hidden_size, self.total_heads * d),
                       self.head_start * d, self.num_heads * d),
        ]  # fmt: skip

    def state_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        shape = (block_size, self.num_kv_heads, self.head_dim)
        return {"k_cache": shape, "v_cache": shape}

    @property
    def in_proj(self) -> torch.Tensor:
        """The fused input projection [q_gate | k | v rows, hidden]."""
        return self.qkv_proj

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        return self.qkv_bias if self.bias else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: AttnLayerState) -> torch.Tensor:
        qkv = add_lora(ctx, self.lora_slots.get("in"), project(x, self.qkv_proj, ctx.kernels, self.in_proj_bias), x)
        return self.mix(qkv, ctx, state)

    def queries_and_cache(
        self, qkv: torch.Tensor, ctx: ForwardContext, state: AttnLayerState
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """From qkv [T, q_gate | k | v]: the normed, rotated queries [T, H, D], the output gate
        [T, H, D] (a view) and the finished (k, v) [T, Hkv, D], which also go into the paged cache."""
        num_tokens, d = qkv.shape[0], self.head_dim
        qs, kvs = self.q_size, self.kv_size
        q_gate = qkv[:, :qs].view(num_tokens, self.num_heads, 2 * d)
        k = qkv[:, qs : qs + kvs].view(num_tokens, self.num_kv_heads, d)
        v = qkv[:, qs + kvs :].view(num_tokens, self.num_kv_heads, d)
        q, k = rotary_kernels.qk_norm_rope(
            q=q_gate[..., :d],
            k=k,
            q_weight=self.q_norm.weight,
            k_weight=self.k_norm.weight,
            positions=ctx.positions,
            eps=self.eps,
            rotary_dim=self.rotary_dim,
            theta=self.rope_theta,
            # the finished k and v go into the paged cache from the same launch
            kv_cache=rotary_kernels.KvCacheWrite(v, state.k_cache, state.v_cache, ctx.slot_mapping),
            pdl=ctx.kernels.pdl,
        )
        return q, q_gate[..., d:], (k, v)

    def mix(
        self, qkv: torch.Tensor, ctx: ForwardContext, state: AttnLayerState, defer_out_lora: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, PairLowRank | None]:
        """Everything after the input projection: qkv [T, q_gate | k | v] -> [T, hidden] (reduced
        over TP ranks). The decoder layer calls it with qkv_proj fused into the input norm.
        defer_out_lora: (that, None), or on one rank (the output projection without its adapters,
        them in low-rank form) for the norm after it (lora.out_lora)."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q, gate, kv = self.queries_and_cache(qkv, ctx, state)  # gate: applied by the decode kernel / below
        num_decode = ctx.num_decode_tokens
        decode_out = prefill_out = None
        if ctx.decode is not None:
            # one query a row, or a speculative verify's k + 1 causal queries a row: the split decode
            # kernel either way, so the rows spread over the GPU (the gate applied inside it)
            decode_out = attn_kernels.paged_decode_attention(
                q=q[:num_decode],
                k_cache=state.k_cache,
                v_cache=state.v_cache,
                seq_lens=ctx.decode.seq_lens,
                block_tables=ctx.decode.block_tables,
                scale=self.scale,
                output_gate=gate[:num_decode],
                pdl=ctx.kernels.pdl,
                tokens_per_row=ctx.decode.tokens_per_row,
            )
        if ctx.prefill is not None:
            prefill = ctx.prefill
            # one sequence's chunk: SDPA over its keys (its own, or all of them out of the pages when
            # some are cached) when the options ask for it; not over FP8 pages, where every query
            # reads the keys and values as the cache holds them. A graph's fresh stream and its
            # padding after it: causal over all of them (the padding's rows are dropped)
            own_kv = None
            keys = prefill.max_query_len if prefill.one_fresh_stream else prefill.max_seq_len
            sdpa = sdpa_chunk(ctx.kernels.prefill_attention, prefill.max_query_len, keys)
            one_sequence = prefill.num_seqs == 1 or prefill.one_fresh_stream
            if sdpa and one_sequence and not attn_kernels.is_fp8_cache(state.k_cache):
                if prefill.one_fresh_stream or prefill.max_query_len == prefill.max_seq_len:
                    own_kv = (kv[0][num_decode:], kv[1][num_decode:])
                else:
                    own_kv = attn_kernels.sequence_kv(
                        k_cache=state.k_cache,
                        v_cache=state.v_cache,
                        block_table=prefill.block_tables[0],
                        length=prefill.max_seq_len,
                    )
            prefill_out = attn_kernels.paged_attention(
                q=q[num_decode:],
                k_cache=state.k_cache,
                v_cache=state.v_cache,
                cu_seqlens_q=prefill.cu_seqlens,
                seq_lens=prefill.seq_lens,
                block_tables=prefill.block_tables,
                scale=self.scale,
                own_kv=own_kv,
                output_gate=gate[num_decode:],
                sdpa_backend=ctx.kernels.sdpa_backend,
            )
        attn = join_rows(decode_out, prefill_out).reshape(num_tokens, self.num_heads * d)
        out = project(attn, self.o_proj, ctx.kernels, self.o_bias if self.bias else None)
        return out_lora(ctx, self.lora_slots.get("out"), out, attn, self.layout, defer=defer_out_lora)


def join_rows(decode: torch.Tensor | None, prefill: torch.Tensor | None) -> torch.Tensor:
    """The decode rows' result followed by the prefill chunk's; no copy when a pass has only one."""
    if decode is None:
        return prefill
    if prefill is None:
        return decode
    return torch.cat((decode, prefill))


def _rank0_bias(name: str, param: torch.Tensor, layout: ParallelLayout) -> CheckpointTensor:
    """A row-parallel layer's bias: rank 0 keeps it, the others zero, so the all-reduce adds it once."""

    def load(t) -> None:
        value = t.get()
        with torch.no_grad():
            param.copy_(value if layout.tp_rank == 0 else torch.zeros_like(value))

    return CheckpointTensor(name, tuple(param.shape), load, init="zeros")
