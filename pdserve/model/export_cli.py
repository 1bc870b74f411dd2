"""`pdserve export-hf`: write a Hugging Face folder from a GGUF (for transformers or vLLM)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export-hf",
        help="write a Hugging Face model folder (config.json, safetensors, "
        "tokenizer.json) from a GGUF",
    )
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.model.export_hf import export_hf

    model = None if args.model in (None, "default") else args.model
    print(export_hf(model, args.out_dir, dtype=args.dtype))
    return 0
