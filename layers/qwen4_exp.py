"""The Qwen4-Exp stack (`qwen4_exp_text`): the Qwen3.5-MoE hybrid of GDN and gated attention with
QSA sparse attention on the attention layers (attention_qsa.py), hyper-connection residual streams
in place of the residual + input norms (hyper_connections.py), and per-layer n-gram embeddings on
chosen GDN layers (ple.py).

    streams = repeat(embed(ids), count)                            [T, count * hidden]
    per layer:  streams += ple(streams)                            (PLE layers only)
                x, w = attn_mixer(streams);  streams += w * mixer(x)     (GDN or QSA attention)
                x, w = mlp_mixer(streams);   streams += w * moe(x)
    logits = lm_head(final_mixer(streams))

Checkpoint names are transformers' (`model.layers.N.{linear_attn,self_attn,mlp,ple,
attn_hyper_connection,mlp_hyper_connection}.*`, `model.hyper_connection_mixer.*`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention_qsa import QsaAttention, QsaCache
from .base import AttnLayerState, CheckpointTensor, ForwardContext, LayerState, SsmLayerState, TransformerLayer
from .config import ATTENTION, ModelConfig
from .gdn import GatedDeltaNet
from .hyper_connections import HyperConnection, add_block_output
from .model import HybridModel
from .moe import SparseMoeBlock
from .parallel import ParallelLayout
from .pass_rows import PassRows, pass_rows
from .ple import PerLayerEmbedding, PleState


@dataclass
class Qwen4SsmLayerState(SsmLayerState):
    """A GDN layer's state slots, and on a PLE layer the PLE state of the same slots."""

    ple: PleState | None = None


class Qwen4ExpDecoderLayer(TransformerLayer):
    def __init__(self, config: ModelConfig, layer_id: int, layout: ParallelLayout):
        super().__init__()
        self.layer_id = layer_id
        self.is_attention = config.layer_types[layer_id] == ATTENTION
        self.state_kind = "attention" if self.is_attention else "ssm"
        self.mixer = QsaAttention(config, layout) if self.is_attention else GatedDeltaNet(config, layout)
        self.mlp = SparseMoeBlock(config, layout)
        h, hc, eps = config.hidden_size, config.hyper, config.rms_norm_eps
        self.attn_hc = HyperConnection(h, hc.count, hc.lowrank, eps)
        self.mlp_hc = HyperConnection(h, hc.count, hc.lowrank, eps)
        ple = config.ple
        self.ple = None
        if ple is not None and layer_id in ple.layer_ids:
            index = ple.layer_ids.index(layer_id)
            self.ple = PerLayerEmbedding(ple, index, config.vocab_size, h, hc.count, eps, layout)

    def checkpoint_tensors(self, prefix: str) -> list[CheckpointTensor]:
        mixer = "self_attn." if self.is_attention else "linear_attn."
        out = [
            *self.mixer.checkpoint_tensors(f"{prefix}{mixer}"),
            *self.mlp.checkpoint_tensors(f"{prefix}mlp."),
            *self.attn_hc.checkpoint_tensors(f"{prefix}attn_hyper_connection."),
            *self.mlp_hc.checkpoint_tensors(f"{prefix}mlp_hyper_connection."),
        ]
        if self.ple is not None:
            out += self.ple.checkpoint_tensors(f"{prefix}ple.")
        return out

    def state_shapes(self, block_size: int = 16) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Attention: K, V and the indexer caches of one page; GDN: the state of one slot (and PLE's)."""
        if self.is_attention:
            return {name: (shape, None) for name, shape in self.mixer.state_shapes(block_size).items()}
        shapes = self.mixer.state_shapes()
        if self.ple is not None:
            shapes.update(self.ple.state_shapes())
        return shapes

    def make_state(self, base: LayerState, extra: dict[str, torch.Tensor]) -> LayerState:
        """The layer's state view from the pool's default one and its views of the extra pools."""
        if self.is_attention:
            return AttnLayerState(base.k_cache, base.v_cache, QsaCache(extra["index_keys"], extra["index_blocks"]))
        if self.ple is None:
            return base
        return Qwen4SsmLayerState(base.recurrent, base.conv, ple=PleState(extra["ple_tokens"], extra["ple_conv"]))

    def verify_buffers(self, state: LayerState, rows: int, length: int) -> dict:
        """SsmLayerState's (and PLE's) speculative-decoding buffers for up to `rows` verify rows of `length` tokens."""
        out = self.mixer.verify_buffers(rows, length, state.conv.device, state.conv.dtype)
        if self.ple is not None:
            out["ple"] = self.ple.verify_buffers(state.ple, rows, length)
        return out

    def write_on_accept(self, state: LayerState, slots: torch.Tensor, last_accepted: torch.Tensor) -> None:
        if not self.is_attention:  # attention: rejected KV and indexer rows are rewritten by later passes
            self.mixer.write_on_accept(state, slots, last_accepted)
        if self.ple is not None:
            self.ple.write_on_accept(state.ple, slots, last_accepted)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext, state: LayerState, rows: PassRows) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, ctx, rows, state.ple)
        x, inject = self.attn_hc(streams, ctx.kernels)
        out = self.mixer(x, ctx, state, rows) if self.is_attention else self.mixer(x, ctx, state)
        streams = add_block_output(streams, out, inject)
        x, inject = self.mlp_hc(streams, ctx.kernels)
        return add_block_output(streams, self.mlp(x, ctx), inject)


class Qwen4ExpModel(HybridModel):
    """HybridModel's interface (embedding, lm_head, logits, state shapes, write-on-accept) over the
    Qwen4-Exp decoder layers."""

    def _build_stack(self, config: ModelConfig, layout: ParallelLayout) -> None:
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(config, i, layout) for i in range(config.num_layers))
        hc = config.hyper
        self.final_mixer = HyperConnection(config.hidden_size, hc.count, hc.lowrank, config.rms_norm_eps, inject=False)

    def checkpoint_tensors(self) -> list[CheckpointTensor]:
        out = [self._vocab_rows("model.embed_tokens.weight", self.embed_tokens)]
        for i, layer in enumerate(self.layers):
            out += layer.checkpoint_tensors(f"model.layers.{i}.")
        out += self.final_mixer.checkpoint_tensors("model.hyper_connection_mixer.")
        if self.lm_head is not None:
            out.append(self._vocab_rows("lm_head.weight", self.lm_head))
        return out

    def forward(self, ctx: ForwardContext, states: list[LayerState]) -> torch.Tensor:
        """Final hidden states [T, hidden] for every token of the pass."""
        rows = pass_rows(ctx)
        streams = self.embed(ctx.input_ids).repeat(1, self.config.hyper.count)
        for layer, state in zip(self.layers, states, strict=True):
            streams = layer(streams, ctx, state, rows)
        return self.final_mixer(streams, ctx.kernels)[0]
