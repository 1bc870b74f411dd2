"""pdserve's tokenizer gives transformers' ids, text and chat prompts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pdserve.model.chat_template import ChatTemplateError
from pdserve.model.config import ModelLoadError
from pdserve.model.tokenizer import Tokenizer
from tests.model.helpers import write_tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "What is 12345 + 678.9? The year 2024 had 366 days.",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "café naïve Straße 東京 Привет мир",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "code: def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n",
    "it's we've they'll I'd",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_gguf) -> Tokenizer:
    return smollm_gguf.tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_tokenizer, tmp_path_factory):
    """transformers' tokenizer on the folder pdserve exports (tokenizer files only)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm_tokenizer.save_hf(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(smollm_tokenizer, hf_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert smollm_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gguf_vocabulary_splits_digits_and_marks_control_tokens(smollm_tokenizer):
    digits = smollm_tokenizer.convert_ids_to_tokens(smollm_tokenizer.encode("2024"))
    assert digits == ["2", "0", "2", "4"]
    assert smollm_tokenizer.encode("<|im_start|>") == [1]
    assert smollm_tokenizer.decode([1, 28120, 2]) == smollm_tokenizer.decode([28120])
    assert (smollm_tokenizer.bos_token_id, smollm_tokenizer.eos_token_id) == (1, 2)
    assert not smollm_tokenizer.add_bos_token
    assert smollm_tokenizer.vocab_size == 49152


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm_tokenizer, hf_tokenizer, messages, add_generation_prompt
):
    ours = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert smollm_tokenizer.encode(ours) == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, return_dict=False
    )


def test_hf_folder_tokenizer_equals_gguf_tokenizer(smollm_tokenizer, tmp_path):
    smollm_tokenizer.save_hf(tmp_path)
    reloaded = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert reloaded.encode(text) == smollm_tokenizer.encode(text)
    assert reloaded.chat_template == smollm_tokenizer.chat_template
    assert (reloaded.bos_token_id, reloaded.eos_token_id) == (1, 2)


def test_template_variables_and_raise_exception(tmp_path: Path):
    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}])
    assert prompt == "<s><|user|>hé</s><|assistant|>"
    assert tokenizer.decode(tokenizer.encode(prompt)) == "hé"
    # The special-token dict form {"content": ...} in tokenizer_config.json is understood.
    assert tokenizer.eos_token_id == tokenizer.encode("</s>")[0]
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages | tojson }}"
    )
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "é"}])
        == '[{"role": "user", "content": "é"}]'
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_cannot_escape_the_sandbox(tmp_path: Path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_hf_folder(tmp_path).apply_chat_template([])


def test_missing_template_and_bad_tokenizer_files(tmp_path: Path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_hf_folder(tmp_path).apply_chat_template([])
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ModelLoadError, match="syntax error"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: cannot parse"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_hf_folder(tmp_path)


def test_encode_lets_other_threads_run(smollm_tokenizer):
    """A server tokenizes a long prompt on a worker thread while its event loop streams
    other requests: encoding must release the GIL."""
    text = "The quick brown fox jumps over the lazy dog. " * 40_000
    count, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before, started = count[0], time.perf_counter()
        ids = smollm_tokenizer.encode(text)
        encode_s = time.perf_counter() - started
        during = count[0] - before
        # What the spinner does in as long with the GIL free: this machine's own pace.
        before = count[0]
        time.sleep(encode_s)
        free = count[0] - before
    finally:
        done.set()
        spinner.join()
    assert len(ids) > 300_000
    # Holding the GIL throughout, the spinner would barely move.
    assert during > free / 4, (during, free)
