import pytest

from pdserve.engine.detokenizer import Detokenizer

TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café",
    "数学 和 世界",
    "party 🎉🎉 time 👩‍👩‍👧",
    "numbers 1234567 and 3.14159",
]


@pytest.fixture(scope="module")
def tokenizer(loaded_fp32):
    return loaded_fp32.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detokenizer = Detokenizer(tokenizer)
    pieces = []
    for i, token in enumerate(ids):
        detokenizer.add_tokens([token])
        piece = detokenizer.take_new_text(is_final=i == len(ids) - 1)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three STOP four five")
    detokenizer = Detokenizer(tokenizer, stop=("STOP",))
    streamed = ""
    for token in ids:
        detokenizer.add_tokens([token])
        streamed += detokenizer.take_new_text(is_final=detokenizer.is_stopped)
        if detokenizer.is_stopped:
            break
    assert detokenizer.is_stopped
    assert streamed == detokenizer.output_text == "one two three "
