import torch

from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.sampler import Sampler

VOCAB = 50


def _request(request_id="r", **params):
    return Request(request_id, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({7}))


def _logits(seed=0):
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits()
    token = Sampler()(logits, [_request(temperature=0)])[0].token_id
    assert token == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    def draw(seed):
        sampler = Sampler(seed=123)
        request = _request(temperature=1.0, seed=seed)
        return [sampler(_logits(i), [request])[0].token_id for i in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(3)
    best = int(logits.argmax())
    sampler = Sampler()
    for _ in range(10):
        assert sampler(logits, [_request(temperature=1.5, top_k=1)])[0].token_id == best
        assert sampler(logits, [_request(temperature=1.5, top_p=1e-6)])[0].token_id == best


def test_top_k_restricts_support():
    logits = _logits(4)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler()
    drawn = {sampler(logits, [_request(temperature=2.0, top_k=3)])[0].token_id for _ in range(60)}
    assert drawn <= allowed and len(drawn) > 1


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # EOS would win
    logits[0, 9] = 9.0  # then a stop token
    request = _request(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[9])
    assert Sampler()(logits, [request])[0].token_id not in (7, 9)


def test_logprobs_are_normalised_and_ranked():
    logits = _logits(5)
    sampled = Sampler()(logits, [_request(temperature=0, logprobs=3)])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert abs(sampled.logprob.logprob - float(expected.max())) < 1e-5
    assert [t for t, _ in sampled.logprob.top_logprobs] == torch.topk(expected, 3).indices.tolist()


def test_extreme_temperature_and_top_p_do_not_break_sampling():
    logits = _logits(6)
    best = int(logits.argmax())
    sampler = Sampler()
    assert sampler(logits, [_request(temperature=1e-40)])[0].token_id == best
    assert sampler(logits, [_request(temperature=1.0, top_p=1e-300)])[0].token_id == best


def _frequencies(params: dict, probs: list[float], draws: int = 20_000) -> list[float]:
    logits = torch.tensor([probs]).log()
    sampler, request = Sampler(seed=11), _request(**params)
    counts = [0] * len(probs)
    for _ in range(draws):
        counts[sampler(logits, [request])[0].token_id] += 1
    return [count / draws for count in counts]


def test_sampling_follows_the_distribution_after_temperature_and_top_p():
    """Frequencies of 20,000 seeded draws within 0.012 (~3.5 standard deviations) of each
    token's probability: the plain distribution, a temperature of 2 (probabilities as the
    square roots, renormalised) and top_p 0.5 (the two likeliest, 0.4 and 0.3, renormalised)."""
    probs = [0.1, 0.2, 0.3, 0.4]
    roots = [p**0.5 for p in probs]
    cases = [
        ({"temperature": 1.0}, probs),
        ({"temperature": 2.0}, [r / sum(roots) for r in roots]),
        ({"temperature": 1.0, "top_p": 0.5}, [0.0, 0.0, 3 / 7, 4 / 7]),
    ]
    for params, expected in cases:
        got = _frequencies(params, probs)
        assert all(abs(g - e) < 0.012 for g, e in zip(got, expected, strict=True)), (params, got)
