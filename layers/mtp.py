"""The checkpoint's multi-token-prediction head (`mtp.*`), the draft model of speculative decoding.

At position p it reads the target's final (normed) hidden state h_p and the embedding of the token
at p + 1, and predicts the token at p + 2:
    x = fc([pre_fc_norm_embedding(embed(t_{p+1})) | pre_fc_norm_hidden(h_p)])
    y = norm(decoder_layer(x))      (one full-attention layer with the family's FFN)
    logits = lm_head(y)
The embedding and lm_head are the target's own. Drafting further than one token feeds y back in
place of h (the head's own output hidden). The decoder layer keeps paged KV like any attention
layer of the stack: the worker's pool gives it one more attention layer, indexed by the request's
own block table.

Sharding follows the stack: the decoder layer is a `DecoderLayer` (attention heads split under TP,
experts split or partitioned under EP); fc is replicated (one [H, 2H] GEMM; a split would cost an
all-gather).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import AttnLayerState, CheckpointTensor, ForwardContext
from .common import RMSNorm, empty_param, project, whole
from .config import ConfigError, ModelConfig
from .kernels import norm as norm_kernels
from .model import DecoderLayer, add_rms_norm
from .parallel import ParallelLayout


class MtpHead(nn.Module):
    def __init__(self, config: ModelConfig, layout: ParallelLayout):
        super().__init__()
        if config.num_mtp_layers != 1:
            raise ConfigError(
                f"config field 'mtp_num_hidden_layers' is {config.num_mtp_layers}; the MTP head needs exactly 1"
            )
        h = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, config.rms_norm_eps)
        self.fc = empty_param(h, 2 * h)
        self.layer = DecoderLayer(config.mtp_layer_config(), 0, layout)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def checkpoint_tensors(self, prefix: str = "mtp.") -> list[CheckpointTensor]:
        return [
            *self.pre_fc_norm_embedding.checkpoint_tensors(f"{prefix}pre_fc_norm_embedding.weight"),
            *self.pre_fc_norm_hidden.checkpoint_tensors(f"{prefix}pre_fc_norm_hidden.weight"),
            whole(f"{prefix}fc.weight", self.fc),
            *self.layer.checkpoint_tensors(f"{prefix}layers.0."),
            *self.norm.checkpoint_tensors(f"{prefix}norm.weight"),
        ]

    def state_shapes(self, block_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        return self.layer.state_shapes(block_size)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, state: AttnLayerState
    ) -> torch.Tensor:
        """embeds [T, H]: the target's embedding of each row's next token; hidden [T, H]: the target's
        final hidden state at the row's position (or the head's own output, drafting further).
        Returns the head's normed output [T, H] (its logits are the target's lm_head of it)."""
        pdl = ctx.kernels.pdl
        e_norm, h_norm = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
        e = norm_kernels.rms_norm(x=embeds, weight=e_norm.weight, eps=e_norm.eps, pdl=pdl)
        h = norm_kernels.rms_norm(x=hidden, weight=h_norm.weight, eps=h_norm.eps, pdl=pdl)
        x = project(torch.cat((e, h), dim=-1), self.fc, ctx.kernels)
        out = self.layer(x, None, ctx, state, next_norm=self.norm)
        return out.hidden if out.normed else add_rms_norm(out.hidden, out.residual, self.norm, ctx.kernels)[0]
