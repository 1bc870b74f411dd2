"""Tokenizers the workloads count prompt tokens with.

Anything with `encode(text) -> list[int]` (no special tokens added) and
`decode(ids) -> str` will do, so the benchmark never needs torch or the model package;
pdserve's own tokenizer is loaded lazily only when no tokenizer file is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from pdserve.workload.errors import BenchError


@runtime_checkable
class TokenizerLike(Protocol):
    """The two calls a workload needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """Adapter over a `tokenizers.Tokenizer` (a Hugging Face `tokenizer.json`)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise BenchError(f"--tokenizer {path}: not a readable tokenizer.json ({exc})") from exc

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: str | Path | None = None) -> TokenizerLike:
    """Load a tokenizer from a `tokenizer.json`, a folder holding one, or a model.

    `spec` None (pdserve's default model), a GGUF file or a model folder is read with
    pdserve's own model loader, imported only then.
    """
    if spec is not None:
        path = Path(spec)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return HFTokenizer.from_file(path / "tokenizer.json")
        if path.suffix == ".json":
            if not path.is_file():
                raise BenchError(f"--tokenizer {path}: no such file")
            return HFTokenizer.from_file(path)
    return _load_model_tokenizer(None if spec is None else str(spec))


def _load_model_tokenizer(model: str | None) -> TokenizerLike:
    # Lazy: pdserve.model pulls in torch, which the benchmark needs for nothing else.
    try:
        from pdserve.model.config import ModelLoadError
        from pdserve.model.loader import open_checkpoint, resolve_model_path
    except ImportError as exc:
        raise BenchError(
            f"cannot load the model's tokenizer ({exc}); pass --tokenizer PATH to a tokenizer.json"
        ) from exc
    try:
        return open_checkpoint(resolve_model_path(model)).tokenizer()
    except ModelLoadError as exc:
        raise BenchError(f"--tokenizer: {exc}") from exc
