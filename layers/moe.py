"""Feed-forward blocks: the sparse MoE block (softmax top-k router, routed experts, shared expert
with its sigmoid gate) and the dense SiLU MLP.

Expert weights are held fused per expert, w13 [E_local, 2 * I_local, H] (gate rows, then up rows)
and w2 [E_local, H, I_local], and load from either checkpoint layout: per expert
(`experts.N.{gate,up,down}_proj.weight`, what transformers saves) or fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).

The shared expert's gate/up, the router and the shared expert's sigmoid gate load into one fused
local weight `in_proj`, rows [shared gate_up (2 * I_shared_local) | router (E) | shared gate (1) |
pad], so every projection that reads the block's input is one GEMM; the router logits come out of
it in the activations' dtype, as from the unfused F.linear. The rows a block-FP8 checkpoint keeps
unquantized (router, gate, pad) come last: under FP8 they are the weight's tail (layers/quant.py).

Parallelism: by default every expert is split along its intermediate dim (column- then
row-parallel); with expert parallelism each rank holds E / tp whole experts and skips tokens routed
elsewhere. Either way the routed and shared partial outputs are summed by one all-reduce. The
router and the shared gate rows are replicated on every rank; the shared expert's gate/up rows
are this rank's column-parallel shard (also under expert parallelism).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .base import CheckpointTensor, ForwardContext, LazyTensor
from .common import col_range, empty_param, project, row_ranges
from .config import ModelConfig
from .kernels import moe as moe_kernels
from .kernels.options import KernelOptions
from .lora import NO_SLOTS, LoraTarget, add_lora, column_target, expert_deltas, low_rank_lora, row_target
from .parallel import ParallelLayout, all_reduce
from .quant import Fp8Projection, assign, rows_of, scale_of, tail_of


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel (fused as w13), down row-parallel.
    `reduce=False` leaves the partial sum for a caller that all-reduces once for several blocks.
    `own_gate_up=False`: the gate/up rows live in a caller's fused weight (the MoE block's in_proj);
    the caller passes it and their first row to checkpoint_tensors and runs `down` on its output."""

    lora_slots = NO_SLOTS  # adapter slots of "in" (gate | up) and "down", once enabled (layers/lora.py)

    def __init__(
        self, hidden_size: int, intermediate_size: int, layout: ParallelLayout, what: str, own_gate_up: bool = True
    ):
        super().__init__()
        self.layout = layout
        self.hidden_size, self.total_inter = hidden_size, intermediate_size
        self.inter_start, self.inter = layout.split(intermediate_size, what)
        if own_gate_up:
            self.w13 = empty_param(2 * self.inter, hidden_size)
        self.w2 = empty_param(hidden_size, self.inter)

    def checkpoint_tensors(
        self, prefix: str, gate_up: torch.Tensor | None = None, first_row: int = 0
    ) -> list[CheckpointTensor]:
        gate_up = self.w13 if gate_up is None else gate_up
        full, i0, inter = (self.total_inter, self.hidden_size), self.inter_start, self.inter
        return [
            row_ranges(f"{prefix}gate_proj.weight", gate_up, full, [(i0, first_row, inter)]),
            row_ranges(f"{prefix}up_proj.weight", gate_up, full, [(i0, first_row + inter, inter)]),
            col_range(f"{prefix}down_proj.weight", self.w2, (self.hidden_size, self.total_inter), i0),
        ]

    def fp8_projections(self, prefix: str) -> list[Fp8Projection]:
        """w13 (when it owns it) and w2; a rank's pieces start on its intermediate width."""
        out = [Fp8Projection(self, "w2", (f"{prefix}down_proj",), row_unit=0, col_unit=self.inter)]
        if hasattr(self, "w13"):
            sources = (f"{prefix}gate_proj", f"{prefix}up_proj")
            out.append(Fp8Projection(self, "w13", sources, row_unit=self.inter, col_unit=0))
        return out

    def lora_targets(self, prefix: str, owner: nn.Module | None = None, first_row: int = 0) -> list[LoraTarget]:
        """gate / up go to `owner`'s "in" slots (itself, or the MoE block whose in_proj holds them)."""
        full, i0, inter = (self.total_inter, self.hidden_size), self.inter_start, self.inter
        owner = self if owner is None else owner
        return [
            column_target(f"{prefix}gate_proj", owner, "in", full, [(i0, first_row, inter)]),
            column_target(f"{prefix}up_proj", owner, "in", full, [(i0, first_row + inter, inter)]),
            row_target(f"{prefix}down_proj", self, "down", (self.hidden_size, self.total_inter), i0, inter),
        ]

    def down(
        self, gate_up: torch.Tensor, kernels: KernelOptions, reduce: bool = True, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        """down(silu(gate) * up) from the gate/up projection's output [T, 2 * I_local]."""
        act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
        out = add_lora(ctx, self.lora_slots.get("down"), project(act, self.w2, kernels), act)
        return all_reduce(out, self.layout) if reduce else out

    def forward(
        self, x: torch.Tensor, kernels: KernelOptions, reduce: bool = True, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        gate_up = add_lora(ctx, self.lora_slots.get("in"), project(x, self.w13, kernels), x)
        return self.down(gate_up, kernels, reduce, ctx)


class SparseMoeBlock(nn.Module):
    # adapter slots of "in" (shared gate_up | router | shared gate) and "experts", once enabled
    lora_slots = NO_SLOTS

    def __init__(self, config: ModelConfig, layout: ParallelLayout):
        super().__init__()
        self.layout = layout
        self.hidden_size = h = config.hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.total_inter = config.moe_intermediate_size
        if layout.expert_parallel:
            self.expert_start, self.num_local_experts = layout.split(config.num_experts, "num_experts")
            self.inter_start, self.inter = 0, config.moe_intermediate_size
        else:
            self.expert_start, self.num_local_experts = 0, config.num_experts
            self.inter_start, self.inter = layout.split(config.moe_intermediate_size, "moe_intermediate_size")
        self.w13 = empty_param(self.num_local_experts, 2 * self.inter, h)
        self.w2 = empty_param(self.num_local_experts, h, self.inter)
        self.shared_expert = None
        self.router_row = 0  # the router's first row of in_proj
        if config.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(
                h, config.shared_expert_intermediate_size, layout, "shared_expert_intermediate_size", own_gate_up=False
            )
            self.router_row = 2 * self.shared_expert.inter
        self.gate_row = self.router_row + config.num_experts  # the shared expert gate's row (with a shared expert)
        rows = self.gate_row + (1 if self.shared_expert is not None else 0)
        # fused input projection: [shared gate_up (this rank's shard) | router | shared gate | unused
        # rows up to a multiple of 8]: cuBLAS takes an sm_75 kernel at 4x the time for N = 1281
        self.in_proj = empty_param(-(-rows // 8) * 8, h)

    @property
    def router(self) -> torch.Tensor:
        """The router's rows of in_proj [E, H]."""
        return rows_of(self.in_proj, self.router_row, self.gate_row)

    @property
    def shared_expert_gate(self) -> torch.Tensor:
        """The shared expert gate's row of in_proj [1, H]."""
        return rows_of(self.in_proj, self.gate_row, self.gate_row + 1)

    def fp8_projections(self, prefix: str) -> list[Fp8Projection]:
        """in_proj's shared gate_up rows (the router, the shared gate and the padding: its tail),
        the experts' w13 and w2, and the shared expert's down projection. A rank's pieces start on
        its intermediate width."""
        experts = range(self.num_experts)
        out = [
            Fp8Projection(
                self, "w13", tuple(f"{prefix}experts.{e}.{p}" for e in experts for p in ("gate_proj", "up_proj")),
                row_unit=self.inter, col_unit=0,
            ),
            Fp8Projection(
                self, "w2", tuple(f"{prefix}experts.{e}.down_proj" for e in experts), row_unit=0, col_unit=self.inter
            ),
        ]  # fmt: skip
        if self.shared_expert is not None:
            shared = tuple(f"{prefix}shared_expert.{p}" for p in ("gate_proj", "up_proj"))
            tail = self.in_proj.shape[0] - self.router_row
            inter = self.shared_expert.inter
            out.append(Fp8Projection(self, "in_proj", shared, tail_rows=tail, row_unit=inter, col_unit=0))
            out += self.shared_expert.fp8_projections(prefix + "shared_expert.")
        return out

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        h, total_inter = self.hidden_size, self.total_inter
        e0, e1 = self.expert_start, self.expert_start + self.num_local_experts
        i0, inter = self.inter_start, self.inter

        def name(e: int, proj: str) -> str:
            return f"{prefix}experts.{e}.{proj}.weight"

        experts = range(self.num_experts)
        # The fused layout first: the random load format fills the first alternative it meets.
        out = [
            CheckpointTensor(
                f"{prefix}experts.gate_up_proj",
                (self.num_experts, 2 * total_inter, h),
                lambda t: self._load_fused_gate_up(t, f"{prefix}experts.gate_up_proj"),
                tuple(name(e, p) for e in experts for p in ("gate_proj", "up_proj")),
                alternative=True,
            ),
            CheckpointTensor(
                f"{prefix}experts.down_proj",
                (self.num_experts, h, total_inter),
                lambda t: assign(
                    self.w2,
                    (slice(None),) * 3,
                    t,
                    (slice(e0, e1), slice(None), slice(i0, i0 + inter)),
                    f"{prefix}experts.down_proj",
                ),
                tuple(name(e, "down_proj") for e in experts),
                alternative=True,
            ),  # fmt: skip
        ]
        for e in experts:
            local = e - e0 if e0 <= e < e1 else None
            for proj in ("gate_proj", "up_proj", "down_proj"):
                shape = (h, total_inter) if proj == "down_proj" else (total_inter, h)
                load = None if local is None else _per_expert_loader(self, local, proj, name(e, proj))
                out.append(CheckpointTensor(name(e, proj), shape, load))
        num_experts = self.num_experts
        router = row_ranges(f"{prefix}gate.weight", self.in_proj, (num_experts, h), [(0, self.router_row, num_experts)])
        out.append(replace(router, load=self._load_router_and_zero_padding(router.load)))
        if self.shared_expert is not None:
            out += self.shared_expert.checkpoint_tensors(f"{prefix}shared_expert.", self.in_proj, 0)
            gate_row = self.gate_row
            out.append(row_ranges(f"{prefix}shared_expert_gate.weight", self.in_proj, (1, h), [(0, gate_row, 1)]))
        return out

    def lora_targets(self, prefix: str) -> list[LoraTarget]:
        h, num_experts = self.hidden_size, self.num_experts
        out = [column_target(f"{prefix}gate", self, "in", (num_experts, h), [(0, self.router_row, num_experts)])]
        if self.shared_expert is not None:
            out += self.shared_expert.lora_targets(f"{prefix}shared_expert.", self, 0)
            out.append(column_target(f"{prefix}shared_expert_gate", self, "in", (1, h), [(0, self.gate_row, 1)]))
        full_13, full_2 = (2 * self.total_inter, h), (h, self.total_inter)
        # the fused 3-D layout (PEFT target_parameters), then per expert (-1: another rank's expert)
        out += [
            LoraTarget(f"{prefix}experts", self, "experts", full_13, h, expert="gate_up"),
            LoraTarget(f"{prefix}experts", self, "experts", full_2, self.inter, expert="down"),
        ]
        e0, e1 = self.expert_start, self.expert_start + self.num_local_experts
        for e in range(num_experts):
            local = e - e0 if e0 <= e < e1 else -1
            for proj, shape in (("gate", (self.total_inter, h)), ("up", (self.total_inter, h)), ("down", full_2)):
                name = f"{prefix}experts.{e}.{proj}_proj"
                out.append(LoraTarget(name, self, "experts", shape, h, expert=proj, expert_index=local))
        return out

    def _load_router_and_zero_padding(self, load_router):
        def load(t: LazyTensor) -> None:
            load_router(t)
            rows = self.in_proj.shape[0] + (0 if tail_of(self.in_proj) is None else tail_of(self.in_proj).shape[0])
            with torch.no_grad():  # the padding rows: never read, but defined
                rows_of(self.in_proj, self.gate_row + (self.shared_expert is not None), rows).zero_()

        return load

    def _load_fused_gate_up(self, t: LazyTensor, name: str) -> None:
        e0, e1 = self.expert_start, self.expert_start + self.num_local_experts
        i0, inter, total = self.inter_start, self.inter, self.total_inter
        every = slice(None)
        assign(self.w13, (every, slice(0, inter), every), t, (slice(e0, e1), slice(i0, i0 + inter)), name)
        up = slice(total + i0, total + i0 + inter)
        assign(self.w13, (every, slice(inter, 2 * inter), every), t, (slice(e0, e1), up), name)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        proj: torch.Tensor | None = None,
        add_norm: moe_kernels.AddNorm | None = None,
    ) -> torch.Tensor | moe_kernels.NormedOut:
        """x [T, H] -> [T, H]. proj: in_proj's output [T, in_proj rows] when the caller has it (the
        decoder layer computes it fused into the post-attention norm), else computed here.
        add_norm: the residual add + norm that follows the block; then the result is NormedOut
        (the experts' last kernel does it on one rank; after the all-reduce under TP)."""
        if proj is None:
            proj = add_lora(ctx, self.lora_slots.get("in"), project(x, self.in_proj, ctx.kernels), x)
        deltas = expert_deltas(ctx, self.lora_slots.get("experts"), x, self.expert_start)
        # the adapters' deltas join inside the experts' kernels, so the next norm stays in the last one
        fused_norm = add_norm if self.layout.tp_size == 1 else None
        num_experts = self.num_experts
        shared = None
        if self.shared_expert is not None:
            gate_up = proj[:, : self.router_row]
            shared = moe_kernels.SharedExpert(
                gate_up=gate_up,
                w2=self.shared_expert.w2,
                gate_logit=proj[:, self.gate_row : self.gate_row + 1],
                w2_scale=scale_of(self.shared_expert.w2),
                # its down adapter on its activation, under its sigmoid gate
                lora=low_rank_lora(ctx, self.shared_expert.lora_slots.get("down"), gate_up, glu=True, fold_into=deltas),
            )
        out = moe_kernels.routed_moe(  # at decode sizes the routing runs inside the experts' up GEMV
            hidden=x,
            w13=self.w13,
            w2=self.w2,
            w13_scale=scale_of(self.w13),
            w2_scale=scale_of(self.w2),
            router_logits=proj[:, self.router_row : self.router_row + num_experts],
            top_k=self.top_k,
            renormalize=self.renormalize,
            expert_offset=self.expert_start,
            shared=shared,  # summed in the same kernel at decode sizes
            add_norm=fused_norm,
            route_in_up_max_tokens=ctx.kernels.route_in_up_max_tokens,
            sorted_block_m=ctx.kernels.moe_sorted_block_m,
            sorted_persistent=ctx.kernels.moe_sorted_persistent,
            pdl=ctx.kernels.pdl,
            deltas=deltas,
            fp8_quantize_acts=moe_kernels.quantizes_fp8_acts(
                ctx.kernels.fp8_activations, x.shape[0] * self.top_k, self.w13.shape[0]
            ),
            prefill_gemm=ctx.kernels.moe_prefill_gemm,
            shared_stream=ctx.kernels.moe_shared_stream,
        )
        if fused_norm is not None or add_norm is None and self.layout.tp_size == 1:
            return out
        return moe_kernels.apply_add_norm(all_reduce(out, self.layout), add_norm, ctx.kernels.pdl)


def _per_expert_loader(block: SparseMoeBlock, local: int, proj: str, name: str):
    i0, inter = block.inter_start, block.inter

    def load(t: LazyTensor) -> None:
        every = slice(None)
        if proj == "gate_proj":
            assign(block.w13, (local, slice(0, inter), every), t, (slice(i0, i0 + inter),), name)
        elif proj == "up_proj":
            assign(block.w13, (local, slice(inter, 2 * inter), every), t, (slice(i0, i0 + inter),), name)
        else:
            assign(block.w2, (local, every, every), t, (every, slice(i0, i0 + inter)), name)

    return load
