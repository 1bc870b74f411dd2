"""Reading a Hugging Face model folder: config.json, (sharded) safetensors, tokenizer files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.model.config import ModelConfig, ModelLoadError, read_json_object
from pdserve.model.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


class HFModelFolder:
    """A folder with config.json and safetensors weights (one file, or shards with an index).

    Raises `ModelLoadError` naming the file at fault.
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        config_path = self.path / "config.json"
        try:
            self.config = ModelConfig.from_hf_config(
                _with_generation_eos(
                    read_json_object(config_path), self.path / "generation_config.json"
                )
            )
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{config_path}: {e}") from None
        self.weight_files = self._weight_files()

    def _weight_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it."""
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            weight_map = read_json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index_path}: no 'weight_map' object")
            files = {name: self.path / file for name, file in weight_map.items()}
            for file in set(files.values()):
                if not file.is_file():
                    raise ModelLoadError(f"{file}: missing (listed in {index_path})")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(
                f"{self.path}: no *.safetensors weights (other weight formats are not supported)"
            )
        files = {}
        for shard in shards:
            with _open(shard) as f:
                files |= dict.fromkeys(f.keys(), shard)
        return files

    @property
    def num_tensors(self) -> int:
        return len(self.weight_files)

    def source_of(self, name: str) -> Path:
        """The file holding a tensor, or where it should have been listed."""
        if name in self.weight_files:
            return self.weight_files[name]
        index_path = self.path / INDEX_FILE
        return index_path if index_path.is_file() else self.path

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_folder(self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor, one file at a time."""
        by_file: dict[Path, list[str]] = {}
        for name, file in self.weight_files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with _open(file) as f:
                available = set(f.keys())
                for name in names:
                    if name not in available:
                        raise ModelLoadError(
                            f"{file}: lacks tensor {name} (listed in {INDEX_FILE})"
                        )
                    try:
                        yield name, f.get_tensor(name)
                    except SafetensorError as e:
                        raise ModelLoadError(f"{file}: cannot read tensor {name} ({e})") from None


def _open(file: Path):  # -> safe_open context manager
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from None


def _with_generation_eos(config: dict, generation_config_path: Path) -> dict:
    # Instruct models often list their end-of-turn tokens only in generation_config.json.
    if not generation_config_path.is_file():
        return config
    extra = read_json_object(generation_config_path).get("eos_token_id")
    if extra is None:
        return config
    ids = config.get("eos_token_id")
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    ids += [extra] if isinstance(extra, int) else list(extra)
    return {**config, "eos_token_id": list(dict.fromkeys(ids))}
