"""specdec: lossless speculative decoding for Hugging Face Llama-family checkpoints."""

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
