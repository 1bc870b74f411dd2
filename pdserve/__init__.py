"""pdserve: prefill/decode-aware LLM serving."""

import os

# torch's OpenMP threads (libgomp) spin for a while after every parallel region, on the cores
# the native kernels' own threads (decode step, prefill attention) then need: two threads ran
# a decode step of 8 sequences slower than one. Passive threads sleep at once. libgomp reads
# this when torch loads it, so it holds where pdserve is imported first (as `pdserve ...`
# commands do); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pdserve.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline engine pulls in torch; import it only when asked for.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
