"""Fixtures for model tests. The real-weight ones are session-scoped: the default GGUF is
read once, exported once to a float32 Hugging Face folder, and loaded once by each side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model.export_hf import export_hf
from pdserve.model.gguf_file import GGUFModelFile
from pdserve.model.loader import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def smollm_gguf() -> GGUFModelFile:
    return GGUFModelFile(default_model_path())


@pytest.fixture(scope="session")
def smollm_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model exported as a float32 Hugging Face folder."""
    return export_hf(None, tmp_path_factory.mktemp("smollm2-hf"), dtype="float32")


@pytest.fixture(scope="session")
def smollm_fp32(smollm_hf_dir: Path) -> LoadedModel:
    return load_model(str(smollm_hf_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smollm(smollm_hf_dir: Path):
    """transformers' LlamaForCausalLM on the exported folder (float32, eval)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(smollm_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_hf_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_hf_dir)
