import pytest

from pdserve.core.sampling_params import InvalidParameterError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_values_name_the_field(kwargs, param):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_normalises_stop_and_top_k():
    params = SamplingParams(stop="END", top_k=0)
    assert params.stop == ("END",) and params.top_k is None
    assert SamplingParams(temperature=0).is_greedy
