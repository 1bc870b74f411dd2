"""`Tokenizer`: text <-> token ids, special tokens and the chat template of a model.

Wraps a `tokenizers.Tokenizer`, loaded from a Hugging Face `tokenizer.json` or built from a
GGUF file's vocabulary and merges, and gives the same ids as transformers for the same text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from pdserve.model.chat_template import ChatTemplate, ChatTemplateError
from pdserve.model.config import ModelLoadError, read_json_object

SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# GGUF `tokenizer.ggml.token_type` of control tokens (<|im_start|>, <|eot_id|>, ...).
GGUF_CONTROL_TOKEN = 3

# Pre-tokenizer split patterns of byte-level BPE vocabularies, keyed by GGUF
# `tokenizer.ggml.pre`. The GPT-2 pattern is ByteLevel's built-in `use_regex`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_raw = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt-2", "gpt2", "default"):
        return byte_level_gpt2
    if pre == "smollm":  # every digit its own pre-token, then GPT-2 splitting
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_gpt2]
        )
    split = {
        "llama-bpe": _LLAMA3_SPLIT,
        "llama3": _LLAMA3_SPLIT,
        "llama-v3": _LLAMA3_SPLIT,
        "smaug-bpe": _LLAMA3_SPLIT,
        "qwen2": _QWEN2_SPLIT,
    }.get(pre)
    if split is None:
        raise ValueError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: "
            "gpt-2, smollm, llama-bpe, qwen2)"
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level_raw]
    )


class Tokenizer:
    """Token ids <-> text for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {role: special_tokens.get(role) for role in SPECIAL_TOKEN_ROLES}
        self.model_max_length = model_max_length
        self.chat_template = chat_template
        self._template = (
            None if chat_template is None else ChatTemplate(chat_template, self.special_tokens)
        )
        self.bos_token_id = self._token_id("bos_token")
        self.eos_token_id = self._token_id("eos_token")
        # Whether encode(..., add_special_tokens=True) prepends BOS (the post-processor's say).
        self.add_bos_token = self.bos_token_id is not None and backend.encode(
            "", add_special_tokens=True
        ).ids[:1] == [self.bos_token_id]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the model's BOS/EOS rules apply.

        Releases the GIL while it runs (`tokenizers` does so in `encode_batch`, not in
        `encode`): a server tokenizing a long prompt on a worker thread keeps streaming."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings (byte-level BPE spells a space as 'Ġ'); None for unknown ids."""
        return [self.backend.id_to_token(i) for i in token_ids]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation. Raises `ChatTemplateError` when the model has
        no template or the template rejects the messages."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        return self._template.render(messages, add_generation_prompt, **kwargs)

    def _token_id(self, role: str) -> int | None:
        token = self.special_tokens[role]
        return None if token is None else self.backend.token_to_id(token)

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """From tokenizer.json, tokenizer_config.json and (if present) chat_template.jinja."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing (pdserve needs a fast-tokenizer tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception
            raise ModelLoadError(f"{path}: cannot parse tokenizer ({e})") from None
        config = (
            read_json_object(folder / "tokenizer_config.json")
            if (folder / "tokenizer_config.json").is_file()
            else {}
        )
        template_file = folder / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _default_template(config.get("chat_template"))
        )
        special = {role: _token_content(config.get(role)) for role in SPECIAL_TOKEN_ROLES}
        return cls._checked(
            backend,
            special,
            template,
            config.get("model_max_length"),
            folder / "tokenizer_config.json",
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str | Path) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` keys and `tokenizer.chat_template`."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"{source}: unsupported GGUF tokenizer model {model!r} "
                "(supported: gpt2 byte-level BPE)"
            )
        try:
            tokens = metadata["tokenizer.ggml.tokens"]
            merges = metadata["tokenizer.ggml.merges"]
            pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        except KeyError as e:
            raise ModelLoadError(f"{source}: GGUF tokenizer lacks {e.args[0]}") from None
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        token_types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab={token: i for i, token in enumerate(tokens)},
                merges=[tuple(merge.split(" ", 1)) for merge in merges],
                fuse_unk=False,
            )
        )
        if metadata.get("tokenizer.ggml.pre") == "qwen2":
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, token_types, strict=True)
                if kind == GGUF_CONTROL_TOKEN
            ]
        )

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return None if index is None else tokens[index]

        special = {
            "bos_token": token("bos"),
            "eos_token": token("eos"),
            "unk_token": token("unknown"),
            "pad_token": token("padding"),
        }
        backend.post_processor = _special_token_processor(
            special["bos_token"] if metadata.get("tokenizer.ggml.add_bos_token") else None,
            special["eos_token"] if metadata.get("tokenizer.ggml.add_eos_token") else None,
            backend,
        )
        arch = metadata.get("general.architecture")
        return cls._checked(
            backend,
            special,
            metadata.get("tokenizer.chat_template"),
            metadata.get(f"{arch}.context_length"),
            source,
        )

    @classmethod
    def _checked(
        cls,
        backend: tokenizers.Tokenizer,
        special: Mapping[str, str | None],
        template: str | None,
        model_max_length: int | None,
        source: str | Path,
    ) -> Tokenizer:
        for role, token in special.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ModelLoadError(f"{source}: {role} {token!r} is not in the vocabulary")
        try:
            return cls(backend, special, template, model_max_length)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{source}: chat template has a syntax error: {e}") from None

    def save_hf(self, out_dir: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (transformers-loadable)."""
        out_dir = Path(out_dir)
        self.backend.save(str(out_dir / "tokenizer.json"))
        added = {
            str(i): {
                "content": token.content,
                "special": token.special,
                "normalized": token.normalized,
                "lstrip": token.lstrip,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
            }
            for i, token in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.model_max_length,
            "chat_template": self.chat_template,
            "added_tokens_decoder": added,
        }
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )


def _special_token_processor(
    bos: str | None, eos: str | None, backend: tokenizers.Tokenizer
) -> processors.PostProcessor | None:
    if bos is None and eos is None:
        return None
    prefix = [f"{bos}:0"] if bos else []
    suffix = [f"{eos}:0"] if eos else []
    return processors.TemplateProcessing(
        single=" ".join([*prefix, "$A:0", *suffix]),
        pair=" ".join([*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix]),
        special_tokens=[(t, backend.token_to_id(t)) for t in (bos, eos) if t],
    )


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json spells a special token as a string or an AddedToken dict.
    return value.get("content") if isinstance(value, Mapping) else value


def _default_template(value: str | list[Mapping[str, str]] | None) -> str | None:
    # Some tokenizer_config.json files hold several named templates; "default" is the chat one.
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value}
        return named.get("default")
    return value
