"""pdserve: prefill/decode-aware LLM serving."""

from pdserve.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline engine pulls in torch; import it only when asked for.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
