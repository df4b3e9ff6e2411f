"""The MTP head in plain torch around transformers' own classes (transformers drops mtp.* weights): its
decoder layer and RMSNorm classes, loaded with the checkpoint's mtp.* tensors, fed the target's final
hidden states from transformers' uncached forward."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from tiny_models import mtp_donor


class Reference:
    """The head in plain torch around transformers' own classes."""

    def __init__(self, family: str, path, hf):
        self.hf = hf
        self.donor = mtp_donor(family)
        self.tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith("mtp.")}

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm = type(self.hf.model.norm)(x.shape[-1], self.hf.config.rms_norm_eps)
        with torch.no_grad():
            norm.weight.copy_(self.tensors[f"mtp.{name}.weight"])
        return norm(x)

    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's final normed hidden state at every position (uncached forward)."""
        with torch.no_grad():
            return self.hf.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]

    def head(self, next_ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, output hidden) at positions 0 .. len - 1, row p reading hidden[p] and next_ids[p]."""
        with torch.no_grad():
            emb = self.hf.model.embed_tokens(torch.tensor(next_ids))
            x = torch.cat([self._norm("pre_fc_norm_embedding", emb), self._norm("pre_fc_norm_hidden", hidden)], -1)
            x = x @ self.tensors["mtp.fc.weight"].T
            n = x.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            pe = self.donor.model.rotary_emb(x[None], pos)
            y = self.donor.model.layers[0](x[None], position_embeddings=pe, attention_mask=mask, position_ids=pos)
            y = self._norm("norm", y[0])
            return self.hf.lm_head(y), y

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after `tokens`: the first from the target's hidden state at the
        second-to-last position and the last token, each next one from the head's own output."""
        next_ids = tokens[1:]
        hidden = self.target_hidden(tokens)[:-1]
        out = []
        for _ in range(k):
            logits, y = self.head(next_ids, hidden)
            out.append(int(logits[-1].argmax()))
            next_ids = next_ids + [out[-1]]
            hidden = torch.cat([hidden, y[-1:]])
        return out
