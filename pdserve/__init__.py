"""pdserve: prefill/decode-aware LLM serving."""

from pdserve.core.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
