"""deltaserve: a serving engine for hybrid linear-attention LLMs.

from deltaserve import LLM, SamplingParams
"""

from deltaserve.cluster.llm import LLM
from deltaserve.cluster.request import CompletionOutput, RequestOutput
from deltaserve.cluster.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
