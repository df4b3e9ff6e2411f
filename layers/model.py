"""The hybrid stack: embedding -> decoder layers (GDN or gated attention, then MoE or dense MLP)
-> final norm -> lm_head. Built from a `ModelConfig`; weights come from `loader.py`.

Checkpoint names are those transformers uses for `*ForCausalLM` (`model.layers.N....`,
`lm_head.weight`); the loader maps composite (`model.language_model.*`) names onto them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import GatedAttention
from .base import (
    AttnLayerState,
    CheckpointTensor,
    ForwardContext,
    LayerState,
    SsmLayerState,
    TransformerLayer,
    copy_into,
)
from .common import RMSNorm, empty_param, project
from .config import ATTENTION, ModelConfig
from .gdn import GatedDeltaNet
from .kernels import linear as linear_kernels
from .kernels import lora as lora_kernels
from .kernels import moe as moe_kernels
from .kernels import norm as norm_kernels
from .kernels.gdn import state as gdn_state
from .kernels.low_rank import PairLowRank
from .kernels.options import KernelOptions
from .lora import LoraTarget, add_lora, lora_wanted
from .moe import DenseMLP, SparseMoeBlock
from .parallel import ParallelLayout, all_gather_last_dim, all_reduce, validate_layout
from .quant import Fp8Projection, scale_of, tail_of


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, kernels: KernelOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one pass over memory."""
    return norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm.weight, eps=norm.eps, pdl=kernels.pdl)


def norm_project(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    weight: torch.Tensor,
    kernels: KernelOptions,
    bias: torch.Tensor | None = None,
    write_normed: bool = False,
    low_rank: PairLowRank | None = None,
) -> linear_kernels.NormLinearOut:
    """The residual add, `norm` and the projection after it (linear_kernels.rms_norm_linear); low_rank:
    x's pending adapters (the projection before, its expand left to the norm)."""
    return linear_kernels.rms_norm_linear(
        x=x, residual=residual, norm_weight=norm.weight, eps=norm.eps, weight=weight, bias=bias,
        write_normed=write_normed, weight_scale=scale_of(weight), weight_tail=tail_of(weight), pdl=kernels.pdl,
        row_gemv=kernels.row_gemv, row_tiles=kernels.row_tiles, low_rank=low_rank, few_rows=kernels.few_rows_gemv,
        few_rows_norm=kernels.few_rows_norm, fp8_gemm=kernels.linear_fp8_gemm(),
    )  # fmt: skip


class DecoderLayer(TransformerLayer):
    """x + mixer(norm(x)), then + ffn(norm(.)): the mixer is gated attention or GDN, the
    feed-forward a sparse MoE block or a dense MLP."""

    def __init__(self, config: ModelConfig, layer_id: int, layout: ParallelLayout):
        super().__init__()
        self.layer_id = layer_id
        self.is_attention = config.layer_types[layer_id] == ATTENTION
        self.state_kind = "attention" if self.is_attention else "ssm"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = GatedAttention(config, layout) if self.is_attention else GatedDeltaNet(config, layout)
        self.is_moe = config.mlp_types[layer_id] == "moe"
        if self.is_moe:
            self.mlp = SparseMoeBlock(config, layout)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, layout, "intermediate_size")

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        mixer = "self_attn." if self.is_attention else "linear_attn."
        return [
            *self.input_layernorm.checkpoint_tensors(f"{prefix}input_layernorm.weight"),
            *self.post_attention_layernorm.checkpoint_tensors(f"{prefix}post_attention_layernorm.weight"),
            *self.mixer.checkpoint_tensors(f"{prefix}{mixer}"),
            *self.mlp.checkpoint_tensors(f"{prefix}mlp."),
        ]

    def fp8_projections(self, prefix: str) -> list[Fp8Projection]:
        """The projections an FP8 scheme may quantize (layers/quant.py)."""
        mixer = "self_attn." if self.is_attention else "linear_attn."
        return self.mixer.fp8_projections(prefix + mixer) + self.mlp.fp8_projections(prefix + "mlp.")

    def lora_targets(self, prefix: str) -> list[LoraTarget]:
        mixer = "self_attn." if self.is_attention else "linear_attn."
        return [*self.mixer.lora_targets(f"{prefix}{mixer}"), *self.mlp.lora_targets(f"{prefix}mlp.")]

    def state_shapes(self, block_size: int = 16) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Attention: K and V shapes of one page; GDN: recurrent and conv shapes of one slot."""
        if self.is_attention:
            return {name: (shape, None) for name, shape in self.mixer.state_shapes(block_size).items()}
        return self.mixer.state_shapes()

    def write_on_accept(self, state: LayerState, slots: torch.Tensor, last_accepted: torch.Tensor) -> None:
        if not self.is_attention:  # attention: rejected KV rows are overwritten by later passes
            self.mixer.write_on_accept(state, slots, last_accepted)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        state: LayerState,
        input_normed: bool = False,
        next_norm: RMSNorm | None = None,
    ) -> LayerOut:
        """(hidden, residual) -> this layer's FFN output and the residual stream before it: the
        residual additions and the norms are fused into the projections that follow them.
        input_normed: hidden is already this layer's input norm of the stream, residual the stream
        (the previous layer's MoE block applied it). next_norm: the norm after this layer (the
        next layer's input norm, or the final one), which an MoE block applies in its last kernel;
        the result says whether it did."""
        if self.is_attention:
            assert isinstance(state, AttnLayerState)
        else:
            assert isinstance(state, SsmLayerState)
        kernels = ctx.kernels
        lora_in = self.mixer.lora_slots.get("in")
        if input_normed:
            x = hidden
            proj = project(hidden, self.mixer.in_proj, kernels, self.mixer.in_proj_bias)
        else:
            proj, x, residual = norm_project(
                hidden, residual, self.input_layernorm, self.mixer.in_proj, kernels, self.mixer.in_proj_bias,
                write_normed=lora_wanted(ctx, lora_in),  # the adapters read the normed input
            )  # fmt: skip
        if not self.is_moe:
            mixed = self.mixer.mix(add_lora(ctx, lora_in, proj, x), ctx, state)
            x, residual = add_rms_norm(mixed, residual, self.post_attention_layernorm, kernels)
            return LayerOut(self.mlp(x, kernels, ctx=ctx), residual, normed=False)
        # the output projection's adapters join in the norm after it (one launch fewer)
        mixed, out_lora = self.mixer.mix(add_lora(ctx, lora_in, proj, x), ctx, state, defer_out_lora=True)
        # the MoE block's experts read the normed input too: the fused kernel writes it
        proj, x, residual = norm_project(
            mixed, residual, self.post_attention_layernorm, self.mlp.in_proj, kernels, write_normed=True,
            low_rank=out_lora,
        )  # fmt: skip
        proj = add_lora(ctx, self.mlp.lora_slots.get("in"), proj, x)
        if next_norm is None:
            return LayerOut(self.mlp(x, ctx, proj), residual, normed=False)
        add_norm = moe_kernels.AddNorm(residual, next_norm.weight, next_norm.eps)
        normed, residual = self.mlp(x, ctx, proj, add_norm=add_norm)
        return LayerOut(normed, residual, normed=True)


class LayerOut(NamedTuple):
    """A decoder layer's result: hidden (its FFN output, or with normed the next norm of the
    stream already applied) and the residual stream (with normed: the stream including it)."""

    hidden: torch.Tensor
    residual: torch.Tensor
    normed: bool


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, layout: ParallelLayout | None = None):
        super().__init__()
        layout = layout or ParallelLayout()
        validate_layout(config, layout)
        self.config, self.layout = config, layout
        # vocab-parallel: each rank holds ceil(V / tp) rows; the last rank's padding rows are zero
        self.vocab_per_rank = -(-config.vocab_size // layout.tp_size)
        self.vocab_start = layout.tp_rank * self.vocab_per_rank
        self.vocab_rows = max(0, min(self.vocab_per_rank, config.vocab_size - self.vocab_start))
        self.embed_tokens = empty_param(self.vocab_per_rank, config.hidden_size)
        self._build_stack(config, layout)
        self.lm_head = None if config.tie_word_embeddings else empty_param(self.vocab_per_rank, config.hidden_size)
        # the MTP head (layers/mtp.py), attached by the loader when speculative decoding uses it
        self.mtp: nn.Module | None = None

    def _build_stack(self, config: ModelConfig, layout: ParallelLayout) -> None:
        """The decoder layers and what follows them (a family with other layers builds its own)."""
        self.layers = nn.ModuleList(DecoderLayer(config, i, layout) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_tensors(self) -> list[CheckpointTensor]:
        out = [self._vocab_rows("model.embed_tokens.weight", self.embed_tokens)]
        for i, layer in enumerate(self.layers):
            out += layer.checkpoint_tensors(f"model.layers.{i}.")
        out += self.norm.checkpoint_tensors("model.norm.weight")
        if self.lm_head is not None:
            out.append(self._vocab_rows("lm_head.weight", self.lm_head))
        if self.mtp is not None:
            out += self.mtp.checkpoint_tensors("mtp.")
        return out

    def fp8_projections(self) -> list[Fp8Projection]:
        """Every projection an FP8 scheme may quantize (the embedding and lm_head stay unquantized),
        the MTP head's decoder layer among them."""
        out = [p for i, layer in enumerate(self.layers) for p in layer.fp8_projections(f"model.layers.{i}.")]
        return out + (self.mtp.fp8_projections("mtp.") if self.mtp is not None else [])

    def lora_targets(self) -> list[LoraTarget]:
        """Every module an adapter may target, with where its delta goes on this rank (layers/lora.py)."""
        return [t for i, layer in enumerate(self.layers) for t in layer.lora_targets(f"model.layers.{i}.")]

    def _vocab_rows(self, name: str, param: torch.Tensor) -> CheckpointTensor:
        start, rows = self.vocab_start, self.vocab_rows

        def load(t) -> None:
            with torch.no_grad():
                param.zero_()
            if rows:
                copy_into(param[:rows], t.get(slice(start, start + rows)), name)

        return CheckpointTensor(name, (self.config.vocab_size, self.config.hidden_size), load)

    # ---- state -------------------------------------------------------------------------------
    def state_shapes(self, block_size: int) -> list[dict[str, tuple[tuple[int, ...], torch.dtype | None]]]:
        return [layer.state_shapes(block_size) for layer in self.layers]

    # ---- forward -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.layout.tp_size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_per_rank)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.embed_tokens)
        out = out * mine[:, None].to(out.dtype)
        return all_reduce(out, self.layout)

    def forward(self, ctx: ForwardContext, states: list[LayerState]) -> torch.Tensor:
        """Final hidden states [T, hidden] for every token of the pass."""
        if ctx.lora is not None:  # the tokens grouped by adapter slot, for every projection's adapters
            ctx.lora.rows = lora_kernels.lora_rows(
                keys=ctx.lora.token_slots, num_keys=ctx.lora.num_slots, pdl=ctx.kernels.pdl
            )
        if self.layout.tp_size == 1:
            # the lookup and the first layer's input norm in one launch
            first = self.layers[0].input_layernorm
            hidden, residual = norm_kernels.embed_rms_norm(
                ids=ctx.input_ids, table=self.embed_tokens, weight=first.weight, eps=first.eps, pdl=ctx.kernels.pdl
            )
            normed = True
        else:
            hidden, residual, normed = self.embed(ctx.input_ids), None, False
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, state, norm_after in zip(self.layers, states, norms_after, strict=True):
            # each MoE block applies the norm after it in its last kernel: one launch fewer a layer
            hidden, residual, normed = layer(hidden, residual, ctx, state, input_normed=normed, next_norm=norm_after)
        return hidden if normed else add_rms_norm(hidden, residual, self.norm, ctx.kernels)[0]

    def mtp_forward(self, ctx: ForwardContext, hidden: torch.Tensor, state: AttnLayerState) -> torch.Tensor:
        """The MTP head over the pass's rows: ctx.input_ids holds each row's next token, hidden [T, H]
        the target's final hidden state at the row (or the head's own output). Returns [T, H]."""
        return self.mtp(self.embed(ctx.input_ids), hidden, ctx, state)

    def write_on_accept(
        self,
        states: list[LayerState],
        slots: torch.Tensor,
        last_accepted: torch.Tensor,
        stack: gdn_state.VerifyStack | None = None,
    ) -> None:
        """After a verify pass: every layer keeps its state after each row's last accepted token.
        stack: the GDN layers' verify buffers as one stack over the states' pools (the state pool's
        `verify_stack`): all of them in two launches; the layers have no other verify state then."""
        if stack is not None:
            gdn_state.accept_all(stack=stack, state_slots=slots, last_accepted=last_accepted)
            return
        for layer, state in zip(self.layers, states, strict=True):
            layer.write_on_accept(state, slots, last_accepted)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] in the weights' dtype for the rows given; gathered over TP ranks. The
        sampler widens them to float32 where it computes with them (penalties, draws, logprobs);
        greedy rows only need their argmax, exact in any dtype."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = all_gather_last_dim(F.linear(hidden, weight), self.layout)
        return logits[:, : self.config.vocab_size]
