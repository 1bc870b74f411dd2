import subprocess
import sys

import pytest

from pdserve.core.sampling_params import InvalidParameterError, SamplingParams


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_kv_blocks=8)  # 128-token context


def test_empty_prompt_rejected(llm):
    with pytest.raises(InvalidParameterError) as info:
        llm.generate([[]], use_tqdm=False)
    assert info.value.param == "prompt"


def test_prompt_longer_than_context_rejected(llm):
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        llm.generate([list(range(200))], use_tqdm=False)


def test_out_of_vocabulary_token_rejected(llm):
    with pytest.raises(InvalidParameterError, match="token ids"):
        llm.generate([[1, 10**9]], use_tqdm=False)


def test_out_of_vocabulary_stop_token_rejected(llm):
    with pytest.raises(InvalidParameterError) as info:
        llm.generate(["Hi"], SamplingParams(stop_token_ids=[10**9]), use_tqdm=False)
    assert info.value.param == "stop_token_ids"


def test_wrong_prompt_type_rejected(llm):
    with pytest.raises(InvalidParameterError):
        llm.generate([3.5], use_tqdm=False)


def test_params_count_mismatch_rejected(llm):
    with pytest.raises(InvalidParameterError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_engine_survives_a_rejected_request(llm):
    with pytest.raises(InvalidParameterError):
        llm.generate([[]], use_tqdm=False)
    result = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(result[0].token_ids) >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model.gguf", "hello"], "model.gguf"),
        (["--max-tokens", "0", "hello"], "max_tokens"),
        (["--temperature", "-2", "hello"], "temperature"),
        (["  "], "prompt"),
    ],
)
def test_cli_errors_are_one_clear_line(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
