"""Gated DeltaNet: input projections, causal conv1d with a carried window, the gated delta rule,
gated RMSNorm and the output projection.

The input projections of both checkpoint layouts load into one fused local weight whose rows are
[q | k | v | z | b | a] (one GEMM per pass):
  * "split" (qwen3_5): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a;
  * "fused_qkvz" (qwen3_next): in_proj_qkvz / in_proj_ba, grouped per key head as
    [q, k, v (r heads), z (r heads)] and [b (r), a (r)] with r = value heads per key head.
The conv runs over the channels [q | k | v] in both layouts.

Decode rows of one token each, in batches of up to KernelOptions.fused_gdn_max_seqs sequences,
run conv, delta rule and gated norm as one kernel (gdn_kernels.fused_gdn_decode); prefill chunks,
larger decode batches and multi-token rows (speculative verify) run them as three ops.

Tensor parallel: key heads split, each with its r value heads and their conv channels;
out_proj is row-parallel with one all-reduce.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import join_rows
from .base import AttnMetadata, CheckpointTensor, ForwardContext, SsmLayerState
from .common import col_range, empty_param, project, row_ranges, whole
from .config import ModelConfig
from .kernels import conv1d as conv_kernels
from .kernels import gdn as gdn_kernels
from .kernels import norm as norm_kernels
from .kernels.gdn import state as gdn_state
from .kernels.low_rank import PairLowRank
from .lora import NO_SLOTS, LoraTarget, add_lora, column_target, out_lora, row_target
from .parallel import ParallelLayout
from .quant import Fp8Projection


class GatedDeltaNet(nn.Module):
    lora_slots = NO_SLOTS  # adapter slots of "in" (the input projections) and "out", once enabled

    def __init__(self, config: ModelConfig, layout: ParallelLayout):
        super().__init__()
        self.layout = layout
        self.config = config
        self.hidden_size = config.hidden_size
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.total_key_heads, self.total_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.group = self.total_value_heads // self.total_key_heads  # value heads per key head
        self.key_head_start, self.num_key_heads = layout.split(self.total_key_heads, "linear_num_key_heads")
        self.value_head_start = self.key_head_start * self.group
        self.num_value_heads = self.num_key_heads * self.group
        self.key_dim = self.num_key_heads * self.key_head_dim
        self.value_dim = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.conv_kernel_size
        self.eps = config.rms_norm_eps

        rows = 2 * self.key_dim + 2 * self.value_dim + 2 * self.num_value_heads
        self.in_proj = empty_param(rows, self.hidden_size)  # [q | k | v | z | b | a]
        self.conv_weight = empty_param(self.conv_dim, 1, self.kernel_size)
        self.A_log = empty_param(self.num_value_heads)
        self.dt_bias = empty_param(self.num_value_heads)
        self.norm_weight = empty_param(self.value_head_dim)
        self.out_proj = empty_param(self.hidden_size, self.value_dim)

    # ---- weights -----------------------------------------------------------------------------
    def _offsets(self) -> dict[str, int]:
        kd, vd, nv = self.key_dim, self.value_dim, self.num_value_heads
        return {"q": 0, "k": kd, "v": 2 * kd, "z": 2 * kd + vd, "b": 2 * kd + 2 * vd, "a": 2 * kd + 2 * vd + nv}

    def _in_proj_parts(self) -> list[tuple[str, tuple[int, int], list[tuple[int, int, int]]]]:
        """The checkpoint's input projections: (module, its weight's shape, the (checkpoint row, fused
        row, rows) pieces this rank takes), in either layout."""
        h, kdim, vdim = self.hidden_size, self.key_head_dim, self.value_head_dim
        total_kd, total_vd = self.total_key_heads * kdim, self.total_value_heads * vdim
        k0, v0, nv = self.key_head_start, self.value_head_start, self.total_value_heads
        off = self._offsets()
        if self.config.gdn_projection == "split":
            qkv = [
                (k0 * kdim, off["q"], self.key_dim),
                (total_kd + k0 * kdim, off["k"], self.key_dim),
                (2 * total_kd + v0 * vdim, off["v"], self.value_dim),
            ]
            return [
                ("in_proj_qkv", (2 * total_kd + total_vd, h), qkv),
                ("in_proj_z", (total_vd, h), [(v0 * vdim, off["z"], self.value_dim)]),
                ("in_proj_b", (nv, h), [(v0, off["b"], self.num_value_heads)]),
                ("in_proj_a", (nv, h), [(v0, off["a"], self.num_value_heads)]),
            ]
        r = self.group
        per_head = 2 * kdim + 2 * r * vdim
        qkvz, ba = [], []
        for i in range(self.num_key_heads):
            base = (k0 + i) * per_head
            qkvz += [
                (base, off["q"] + i * kdim, kdim),
                (base + kdim, off["k"] + i * kdim, kdim),
                (base + 2 * kdim, off["v"] + i * r * vdim, r * vdim),
                (base + 2 * kdim + r * vdim, off["z"] + i * r * vdim, r * vdim),
            ]
            ba += [((k0 + i) * 2 * r, off["b"] + i * r, r), ((k0 + i) * 2 * r + r, off["a"] + i * r, r)]
        return [
            ("in_proj_qkvz", (self.total_key_heads * per_head, h), qkvz),
            ("in_proj_ba", (self.total_key_heads * 2 * r, h), ba),
        ]

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        h, kdim, vdim = self.hidden_size, self.key_head_dim, self.value_head_dim
        total_kd, total_vd = self.total_key_heads * kdim, self.total_value_heads * vdim
        k0, v0 = self.key_head_start, self.value_head_start
        out = [
            row_ranges(f"{prefix}{name}.weight", self.in_proj, shape, pieces)
            for name, shape, pieces in self._in_proj_parts()
        ]
        out += [
            row_ranges(
                f"{prefix}conv1d.weight",
                self.conv_weight,
                (2 * total_kd + total_vd, 1, self.kernel_size),
                [
                    (k0 * kdim, 0, self.key_dim),
                    (total_kd + k0 * kdim, self.key_dim, self.key_dim),
                    (2 * total_kd + v0 * vdim, 2 * self.key_dim, self.value_dim),
                ],
            ),
            row_ranges(
                f"{prefix}A_log", self.A_log, (self.total_value_heads,), [(v0, 0, self.num_value_heads)], init="a_log"
            ),
            row_ranges(
                f"{prefix}dt_bias",
                self.dt_bias,
                (self.total_value_heads,),
                [(v0, 0, self.num_value_heads)],
                init="ones",
            ),
            whole(f"{prefix}norm.weight", self.norm_weight, init="ones"),
            col_range(f"{prefix}out_proj.weight", self.out_proj, (h, total_vd), v0 * vdim),
        ]
        return out

    def fp8_projections(self, prefix: str) -> list[Fp8Projection]:
        """in_proj's q | k | v | z rows (b and a stay unquantized: its tail) and out_proj; pieces
        of whole heads."""
        if self.config.gdn_projection == "split":
            sources = (f"{prefix}in_proj_qkv", f"{prefix}in_proj_z")
        else:
            sources = (f"{prefix}in_proj_qkvz",)
        unit = math.gcd(self.key_head_dim, self.value_head_dim)
        return [
            Fp8Projection(self, "in_proj", sources, tail_rows=2 * self.num_value_heads, row_unit=unit, col_unit=0),
            Fp8Projection(self, "out_proj", (f"{prefix}out_proj",), row_unit=0, col_unit=self.value_head_dim),
        ]

    def lora_targets(self, prefix: str) -> list[LoraTarget]:
        targets = [
            column_target(f"{prefix}{name}", self, "in", shape, pieces) for name, shape, pieces in self._in_proj_parts()
        ]
        total_vd = self.total_value_heads * self.value_head_dim
        start = self.value_head_start * self.value_head_dim
        return targets + [
            row_target(f"{prefix}out_proj", self, "out", (self.hidden_size, total_vd), start, self.value_dim)
        ]

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return {
            "recurrent": ((self.num_value_heads, self.key_head_dim, self.value_head_dim), torch.float32),
            "conv": ((self.conv_dim, self.kernel_size - 1), None),
        }

    in_proj_bias = None  # the decoder layer's fused norm + in_proj reads it, as for attention

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: SsmLayerState) -> torch.Tensor:
        return self.mix(add_lora(ctx, self.lora_slots.get("in"), project(x, self.in_proj, ctx.kernels), x), ctx, state)

    def mix(
        self, proj: torch.Tensor, ctx: ForwardContext, state: SsmLayerState, defer_out_lora: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, PairLowRank | None]:
        """Everything after the input projection: proj [T, in_proj rows] -> [T, hidden] (reduced
        over TP ranks). The decoder layer calls it with in_proj fused into the input norm.
        defer_out_lora: (that, None), or on one rank (the output projection without its adapters,
        them in low-rank form) for the norm after it (lora.out_lora)."""
        num_tokens = proj.shape[0]
        off = self._offsets()
        mixed = proj[:, : self.conv_dim]
        z = proj[:, off["z"] : off["b"]].reshape(num_tokens, self.num_value_heads, self.value_head_dim)
        b, a = proj[:, off["b"] : off["a"]], proj[:, off["a"] :]
        conv_weight = self.conv_weight.squeeze(1)

        num_decode = ctx.num_decode_tokens
        decode = ctx.decode
        if decode is not None and decode.tokens_per_row == 1 and decode.num_seqs <= ctx.kernels.fused_gdn_max_seqs:
            # small batches of one token per row: conv, delta rule and gated norm in one launch
            # (three at batch 1 are mostly launch latency); the prefill rows take the separate ops
            core_decode = gdn_kernels.fused_gdn_decode(
                mixed_qkv=mixed[:num_decode],
                z=z[:num_decode],
                a=a[:num_decode],
                b=b[:num_decode],
                conv_weight=conv_weight,
                conv_state_pool=state.conv,
                A_log=self.A_log,
                dt_bias=self.dt_bias,
                state_pool=state.recurrent,
                state_slots=decode.state_slots,
                norm_weight=self.norm_weight,
                eps=self.eps,
                pdl=ctx.kernels.pdl,
            )
            core_prefill = None
            if ctx.prefill is not None:
                rows = slice(num_decode, None)
                core_prefill = self._unfused(mixed[rows], z[rows], a[rows], b[rows], conv_weight, None, ctx, state)
            core = join_rows(core_decode, core_prefill)
        else:
            core = self._unfused(mixed, z, a, b, conv_weight, ctx.decode, ctx, state)
        core = core.reshape(num_tokens, self.value_dim)
        out = project(core, self.out_proj, ctx.kernels)
        return out_lora(ctx, self.lora_slots.get("out"), out, core, self.layout, defer=defer_out_lora)

    def _unfused(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_weight: torch.Tensor,
        decode: AttnMetadata | None,
        ctx: ForwardContext,
        state: SsmLayerState,
    ) -> torch.Tensor:
        """conv1d, the gated delta rule and the gated norm as separate ops over `decode`'s rows (any
        tokens_per_row; None: no decode rows) followed by the prefill chunk's. mixed: [T, conv_dim];
        z: [T, Hv, V]; a, b: [T, Hv]. Returns the normed heads [T, Hv, V]."""
        num_tokens = mixed.shape[0]
        off = self._offsets()
        num_decode = 0 if decode is None else decode.num_tokens
        conv_decode = conv_prefill = None
        verify = decode is not None and decode.tokens_per_row > 1 and state.verify is not None
        if decode is not None and decode.tokens_per_row == 1:
            conv_decode = conv_kernels.causal_conv1d_update(
                x=mixed[:num_decode],
                weight=conv_weight,
                conv_state_pool=state.conv,
                state_slots=decode.state_slots,
                activation="silu",
                pdl=ctx.kernels.pdl,
            )
        elif decode is not None:  # k + 1 tokens a row (speculative verify): each row a short sequence
            n = decode.num_seqs
            saved = None
            if verify:  # the slots keep their windows; write-on-accept rebuilds them with these inputs
                saved = state.verify_conv_inputs[:n].view(num_decode, -1)
                has_initial = state.verify_has_initial[:n]
            else:
                has_initial = torch.ones(n, dtype=torch.bool, device=mixed.device)
            conv_decode = conv_kernels.causal_conv1d_varlen(
                x=mixed[:num_decode],
                weight=conv_weight,
                bias=None,
                cu_seqlens=decode.row_starts(),
                conv_state_pool=state.conv,
                state_slots=decode.state_slots,
                has_initial_state=has_initial,
                activation="silu",
                update_state=not verify,
                save_inputs=saved,
            )
        if ctx.prefill is not None:
            conv_prefill = conv_kernels.causal_conv1d_varlen(
                x=mixed[num_decode:],
                weight=conv_weight,
                cu_seqlens=ctx.prefill.cu_seqlens,
                conv_state_pool=state.conv,
                state_slots=ctx.prefill.state_slots,
                has_initial_state=ctx.prefill.has_initial_state,
                activation="silu",
                captures=ctx.midchunk_capture,
            )
        conv_out = join_rows(conv_decode, conv_prefill)
        q = conv_out[:, off["q"] : off["k"]].reshape(num_tokens, self.num_key_heads, self.key_head_dim)
        k = conv_out[:, off["k"] : off["v"]].reshape(num_tokens, self.num_key_heads, self.key_head_dim)
        v = conv_out[:, off["v"] :].reshape(num_tokens, self.num_value_heads, self.value_head_dim)
        # g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): decode computes them inside the
        # recurrent kernel from the raw a, b; prefill in one fused gating launch

        core_decode = core_prefill = None
        if decode is not None:
            n = decode.num_seqs
            rows = decode.tokens_per_row
            core_decode = gdn_kernels.fused_recurrent_gated_delta_rule(
                q=q[:num_decode].view(n, rows, *q.shape[1:]),
                k=k[:num_decode].view(n, rows, *k.shape[1:]),
                v=v[:num_decode].view(n, rows, *v.shape[1:]),
                a=a[:num_decode].view(n, rows, -1),
                b=b[:num_decode].view(n, rows, -1),
                A_log=self.A_log,
                dt_bias=self.dt_bias,
                state_pool=state.recurrent,
                state_slots=decode.state_slots,
                use_qk_l2norm=True,
                # a verify keeps the slots' states and records each step; write_on_accept applies them
                update_state=not verify,
                verify_table=_rows(state.verify, n) if verify else None,
                pdl=ctx.kernels.pdl,
            ).view(num_decode, *v.shape[1:])
        if ctx.prefill is not None:
            g, beta = gdn_kernels.gdn_gating(a=a[num_decode:], b=b[num_decode:], A_log=self.A_log, dt_bias=self.dt_bias)
            core_prefill = gdn_kernels.chunk_gated_delta_rule(
                q=q[num_decode:],
                k=k[num_decode:],
                v=v[num_decode:],
                g=g,
                beta=beta,
                cu_seqlens=ctx.prefill.cu_seqlens,
                state_pool=state.recurrent,
                state_slots=ctx.prefill.state_slots,
                has_initial_state=ctx.prefill.has_initial_state,
                use_qk_l2norm=True,
                captures=ctx.midchunk_capture,
                variant=ctx.kernels.gdn_chunk_variant,
                norm_gate=z[num_decode:],  # the output norm inside the chunked op's last kernel
                norm_weight=self.norm_weight,
                norm_eps=self.eps,
            )
        if core_decode is not None:
            core_decode = norm_kernels.gated_rms_norm(
                x=core_decode, gate=z[:num_decode], weight=self.norm_weight, eps=self.eps, pdl=ctx.kernels.pdl
            )
        return join_rows(core_decode, core_prefill)

    # ---- speculative decoding -----------------------------------------------------------------
    def verify_buffers(self, rows: int, length: int, device: torch.device | str, dtype: torch.dtype) -> dict:
        """SsmLayerState's verify fields for up to `rows` verify rows of `length` tokens."""
        return {
            "verify": gdn_state.VerifyTable.empty(
                rows, length, self.num_value_heads, self.key_head_dim, self.value_head_dim, device
            ),
            "verify_conv_inputs": torch.zeros((rows, length, self.conv_dim), dtype=dtype, device=device),
            "verify_has_initial": torch.ones(rows, dtype=torch.bool, device=device),
        }

    def write_on_accept(self, state: SsmLayerState, slots: torch.Tensor, last_accepted: torch.Tensor) -> None:
        """After a verify pass of the first len(slots) rows: each slot keeps its state after the
        row's last accepted token (replayed from the verify table), and the matching conv window."""
        n = slots.shape[0]
        gdn_state.accept_states(
            state_pool=state.recurrent, state_slots=slots, table=_rows(state.verify, n), last_accepted=last_accepted
        )
        gdn_state.conv_accept(
            conv_state_pool=state.conv,
            state_slots=slots,
            x=state.verify_conv_inputs[:n],
            last_accepted=last_accepted,
        )


def _rows(table: gdn_state.VerifyTable, n: int) -> gdn_state.VerifyTable:
    """The first n rows of a verify table (views)."""
    return gdn_state.VerifyTable(table.k[:n], table.delta[:n], table.g[:n])
