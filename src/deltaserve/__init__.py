"""deltaserve: a serving engine for hybrid linear-attention LLMs.

from deltaserve import LLM, SamplingParams
"""

__version__ = "0.1.0"
