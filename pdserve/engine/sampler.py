"""Turns the logits of the rows that sample into tokens (and logprobs when asked)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core.request import Request
from pdserve.engine.outputs import TokenLogprob


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with per-request seeded generators.

    A request with a seed owns a `torch.Generator` for its whole life, so its output is
    reproducible whatever else shares the batch.
    """

    def __init__(self, seed: int = 0) -> None:
        self._default_generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [N, vocab] float32, one row per request in `requests` (same order)."""
        logits = logits.float().cpu()
        self._mask_early_stops(logits, requests)
        # numpy's argmax (the first maximum, as torch's) takes 3 us a 49k-token row where
        # torch's takes 43 (one Zen 4 thread): 1.3 ms of a 32-row step.
        token_ids = logits.numpy().argmax(axis=-1).tolist()
        for row, request in enumerate(requests):
            if not request.sampling_params.is_greedy:
                token_ids[row] = self._sample_row(logits[row], request)
        return [
            SampledToken(t, self._logprob(logits[row], t, request))
            for row, (t, request) in enumerate(zip(token_ids, requests, strict=True))
        ]

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Before `min_tokens` outputs, EOS and stop tokens cannot be sampled."""
        for row, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens:
                continue
            banned = [*params.stop_token_ids, *request.eos_token_ids]
            logits[row, banned] = float("-inf")

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        """A token drawn from the row's distribution after temperature, top-k and top-p, by
        inverting its CDF at one uniform draw of the request's generator: exact, and ~0.19 ms
        a 49k-token row where `torch.multinomial` (an exponential draw per token) took ~1.3
        ms (Sapphire Rapids, 2 threads): 40 ms a step of 32 streams sampling."""
        params = request.sampling_params
        logits = row.numpy() / np.float32(params.temperature)
        if params.top_k is not None and params.top_k < logits.size:
            kth = np.partition(logits, -params.top_k)[-params.top_k]
            logits = np.where(logits < kth, -np.inf, logits)
        weights = np.exp(logits - logits.max())  # unnormalised probabilities, the best 1
        if params.top_p < 1.0:
            candidates = np.flatnonzero(weights)  # after top_k, only those need sorting
            order = candidates[np.argsort(-weights[candidates], kind="stable")]
            ranked = weights[order].astype(np.float64)
            mass_before = np.cumsum(ranked) - ranked
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            kept = max(1, int(np.searchsorted(mass_before, params.top_p * ranked.sum())))
            weights = np.zeros_like(weights)
            weights[order[:kept]] = ranked[:kept]
        cdf = np.cumsum(weights, dtype=np.float64)
        draw = torch.rand((), dtype=torch.float64, generator=self._generator(request)).item()
        # A token of zero weight never holds the step where the CDF passes draw * total.
        return min(int(np.searchsorted(cdf, draw * cdf[-1], side="right")), len(cdf) - 1)

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._default_generator
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    @staticmethod
    def _logprob(row: torch.Tensor, token_id: int, request: Request) -> TokenLogprob | None:
        num_top = request.sampling_params.logprobs
        if num_top is None:
            return None
        logprobs = torch.log_softmax(row, dim=-1)
        top = torch.topk(logprobs, num_top) if num_top else None
        top_list = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
        return TokenLogprob(token_id, float(logprobs[token_id]), top_list)
