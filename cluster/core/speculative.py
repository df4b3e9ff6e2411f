"""Speculative decoding on the driver: the acceptance counters (the setting itself,
`speculative_config`, is RunnerConfig's).

Every request decodes in verify rows once it has drafts: its last token and the k drafts the MTP head
proposed after the previous pass, verified by the target in one pass (the worker keeps the drafts up
to the first disagreement and the target's token after them). Each position is sampled as the decode
step after the drafts before it: its grammar mask, logit bias, penalties and min_tokens bans
included (workers/sampler.py's sample_verify).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculativeInfo:
    """Speculative decoding as served, and its counters so far (GetModelInfo)."""

    method: str
    num_speculative_tokens: int
    num_drafts: int  # verify rows
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    mean_acceptance_length: float

    @classmethod
    def total(cls, infos: Sequence[SpeculativeInfo]) -> SpeculativeInfo:
        """Several engines' counters added up (data-parallel replicas serving one model)."""
        first = infos[0]
        drafts = sum(i.num_drafts for i in infos)
        accepted = sum(i.num_accepted_tokens for i in infos)
        per_position = zip(*(i.accepted_per_position for i in infos), strict=True)
        return cls(
            method=first.method,
            num_speculative_tokens=first.num_speculative_tokens,
            num_drafts=drafts,
            num_draft_tokens=sum(i.num_draft_tokens for i in infos),
            num_accepted_tokens=accepted,
            accepted_per_position=tuple(sum(col) for col in per_position),
            mean_acceptance_length=1 + accepted / drafts if drafts else 0.0,
        )


@dataclass
class SpecStats:
    """Drafts proposed and accepted: per verify row, k proposed and the accepted ones (a prefix)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.num_speculative_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row emits on average: its accepted drafts and the target's token (vLLM's
        definition); 0 before any verify."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def info(self, method: str = "mtp") -> SpeculativeInfo:
        return SpeculativeInfo(
            method=method,
            num_speculative_tokens=self.num_speculative_tokens,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            accepted_per_position=tuple(self.accepted_per_position),
            mean_acceptance_length=self.mean_acceptance_length,
        )

    def as_dict(self) -> dict:
        rates = [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": rates,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
