"""deltaserve: a serving engine for hybrid linear-attention LLMs.

from deltaserve import LLM, SamplingParams, StructuredOutputsParams

The names below load on first use, so that `import deltaserve` (and the thin `deltaserve generate`
client) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

_LAZY = {
    "LLM": "deltaserve.cluster.entrypoints.llm",
    "LoRARequest": "deltaserve.cluster.core.lora",
    "SamplingParams": "deltaserve.cluster.core.sampling_params",
    "StructuredOutputsParams": "deltaserve.cluster.core.sampling_params",
    "RequestOutput": "deltaserve.cluster.core.request",
    "CompletionOutput": "deltaserve.cluster.core.request",
}

if TYPE_CHECKING:
    from deltaserve.cluster.core.lora import LoRARequest
    from deltaserve.cluster.core.request import CompletionOutput, RequestOutput
    from deltaserve.cluster.core.sampling_params import SamplingParams, StructuredOutputsParams
    from deltaserve.cluster.entrypoints.llm import LLM


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
