"""Export a GGUF checkpoint as a Hugging Face folder that transformers, vLLM and pdserve load.

The folder holds config.json, model.safetensors (dequantized, Hugging Face layout),
tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json.

    python -m pdserve.model.export_hf [--dtype float32|bfloat16] [GGUF] OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from pdserve.model.config import ModelLoadError
from pdserve.model.gguf_file import GGUFModelFile
from pdserve.model.loader import DTYPES, default_model_path, read_weights


def export_hf(gguf_path: str | Path | None, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder for `gguf_path` (None: the default model) to `out_dir`;
    returns `out_dir`. Raises `ModelLoadError` for an unusable GGUF or dtype."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    checkpoint = GGUFModelFile(default_model_path() if gguf_path is None else gguf_path)
    config = checkpoint.config
    tokenizer = checkpoint.tokenizer()
    weights = {
        name: tensor.to(DTYPES[dtype]).contiguous()
        for name, tensor in read_weights(checkpoint, config).items()
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config = config.to_hf_config() | {"torch_dtype": dtype, "dtype": dtype}
    _write_json(out_dir / "config.json", hf_config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"]},
    )
    tokenizer.save_hf(out_dir)
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.model.export_hf", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "gguf",
        nargs="?",
        default=None,
        help="the .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument("out_dir", help="folder to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parser.parse_args(argv)
    try:
        out_dir = export_hf(args.gguf, args.out_dir, args.dtype)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
