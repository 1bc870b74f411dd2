"""Loading Hugging Face folders and GGUF files, device/dtype resolution, and load errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.model.attention import AttentionMetadata, allocate_kv_cache
from pdserve.model.config import ModelLoadError
from pdserve.model.cpu_runtime import HUGE_PAGE_BYTES, huge_page_buffer, read_cpu_flags
from pdserve.model.layers import Linear
from pdserve.model.loader import default_model_path, load_model, resolve_device, resolve_dtype
from tests.model.helpers import tiny_hf_model, write_tiny_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_hf_model("qwen2", seed=5)


@pytest.fixture
def tiny_folder(tiny_model, tmp_path: Path) -> Path:
    tiny_model.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path)
    return tmp_path


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = allocate_kv_cache(loaded.config, 4, 16, loaded.dtype, loaded.device)
    meta = AttentionMetadata.build([([0, 1, 2, 3], 0, len(ids))], 16, "cpu")
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, meta)
    return loaded.model.compute_logits(hidden)


def _assert_matches_hf(loaded, hf_model) -> None:
    ids = loaded.tokenizer.encode(
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, model!"}])
    )
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(loaded, ids), expected, atol=2e-4, rtol=1e-4)


def test_hf_folder_loads_with_tokenizer(tiny_folder, tiny_model):
    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu")
    assert loaded.name == tiny_folder.name and loaded.path == tiny_folder
    assert (loaded.dtype, loaded.device) == (torch.float32, CPU)
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.attention_bias
    assert loaded.tokenizer.eos_token_id == 257
    _assert_matches_hf(loaded, tiny_model)


def test_sharded_safetensors_with_index(tiny_folder, tiny_model):
    weights = load_file(tiny_folder / "model.safetensors")
    (tiny_folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, tiny_folder / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tiny_folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    loaded = load_model(str(tiny_folder), dtype="float32", device="cpu")
    _assert_matches_hf(loaded, tiny_model)


def test_bfloat16_load(tiny_folder):
    loaded = load_model(str(tiny_folder), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.embed_tokens.dtype == torch.bfloat16
    assert torch.isfinite(_logits(loaded, [1, 2, 3])).all()


def _rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _truncate(path: Path, num_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:-num_bytes])


def _replace_tensor(folder: Path, name: str, tensor: torch.Tensor | None) -> None:
    weights = load_file(folder / "model.safetensors")
    if tensor is None:
        del weights[name]
    else:
        weights[name] = tensor
    save_file(weights, folder / "model.safetensors")


LAYER0 = "model.layers.0.self_attn."


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (lambda f: (f / "config.json").unlink(), "config.json", "missing"),
        (lambda f: (f / "config.json").write_text("{"), "config.json", "cannot read JSON"),
        (
            lambda f: _rewrite_config(f, architectures=["BertModel"]),
            "config.json",
            "unsupported architecture 'BertModel'",
        ),
        (
            lambda f: _rewrite_config(f, num_attention_heads=3),
            "config.json",
            "multiple of num_key_value_heads",
        ),
        (
            lambda f: _truncate(f / "model.safetensors", 100),
            "model.safetensors",
            "corrupt or truncated safetensors",
        ),
        (lambda f: (f / "model.safetensors").unlink(), "", "no \\*.safetensors weights"),
        (
            lambda f: _replace_tensor(f, LAYER0 + "k_proj.weight", torch.zeros(16, 64)),
            "model.safetensors",
            r"k_proj.weight has shape \[16, 64\], but the config needs \[32, 64\]",
        ),
        (
            lambda f: _replace_tensor(f, LAYER0 + "q_proj.bias", None),
            "",
            "missing tensor model.layers.0.self_attn.q_proj.bias",
        ),
        (
            lambda f: _replace_tensor(f, LAYER0 + "v_proj.weight", torch.full((32, 64), torch.nan)),
            "model.safetensors",
            "contains NaN or infinite values",
        ),
        (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json", "missing"),
    ],
)
def test_broken_folders_name_the_file(tiny_folder, damage, file, message):
    damage(tiny_folder)
    with pytest.raises(ModelLoadError, match=message) as error:
        load_model(str(tiny_folder), dtype="float32", device="cpu")
    assert str(error.value).startswith(str(tiny_folder / file).rstrip("/"))


def test_shard_listed_in_index_but_absent(tiny_folder):
    (tiny_folder / "model.safetensors").rename(tiny_folder / "shard-1.safetensors")
    (tiny_folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.norm.weight": "shard-1.safetensors",
                    "lm_head.weight": "shard-2.safetensors",
                }
            }
        )
    )
    with pytest.raises(ModelLoadError, match=r"shard-2\.safetensors: missing \(listed in"):
        load_model(str(tiny_folder), dtype="float32", device="cpu")


def test_bad_model_paths(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu")
    text = tmp_path / "weights.bin"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file or a Hugging Face model folder"):
        load_model(str(text), device="cpu")


def test_truncated_and_fake_gguf_name_the_file(tmp_path: Path):
    truncated = tmp_path / "truncated.gguf"
    with default_model_path().open("rb") as f:
        truncated.write_bytes(f.read(3_000_000))
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf: corrupt or truncated GGUF"):
        load_model(str(truncated), device="cpu")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError, match=r"fake\.gguf: corrupt or truncated GGUF"):
        load_model(str(fake), device="cpu")


def test_default_model_is_the_bundled_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_dtype_resolution():
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    for measured in (torch.bfloat16, torch.float32):
        assert resolve_dtype("auto", CPU, lambda measured=measured: measured) is measured
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="dtype must be one of float32, bfloat16"):
        resolve_dtype("float16", CPU)


def test_cpu_flags_from_cpuinfo(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\nbugs\t: x\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx512f", "avx512_bf16"}
    assert read_cpu_flags(tmp_path / "absent") == frozenset()


def mapping_field(address: int, field: str) -> str | None:
    """`field` of the /proc/self/smaps entry of the mapping holding `address`."""
    is_holder = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            is_holder = low <= address < high
        elif is_holder and head == f"{field}:":
            return line.split()[1]
    return None


def asks_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` may get 2 MiB pages (always, if the kernel has
    transparent huge pages switched off)."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return True
    return mapping_field(address, "THPeligible") == "1"


def test_huge_page_buffer_is_zero_aligned_and_asks_for_huge_pages():
    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES + 100)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 100
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not buffer.any()
    assert asks_for_huge_pages(buffer.data_ptr())


def test_packed_weights_and_kv_cache_sit_in_huge_pages(tiny_folder, tiny_model):
    """Decode streams both: each in a mapping asked for 2 MiB pages, and the weights moved
    there still give the model's logits."""
    loaded = load_model(tiny_folder, dtype="float32", device="cpu")
    weights = [
        module.kernel_weight.data
        for module in loaded.model.modules()
        if isinstance(module, Linear) and module.kernel_weight is not None
    ]
    if loaded.model.cpu_ops is None:
        pytest.skip("no CPU kernels here: no packed weights")
    assert weights and all(asks_for_huge_pages(weight.data_ptr()) for weight in weights)
    assert weights[0].data_ptr() % HUGE_PAGE_BYTES == 0
    cache = allocate_kv_cache(loaded.config, 4, 16, loaded.dtype, loaded.device)
    assert not cache.any() and asks_for_huge_pages(cache.data_ptr())
    # Resident already: a decode step that first wrote a page would clear it mid-step.
    nbytes = cache.numel() * cache.element_size()
    assert int(mapping_field(cache.data_ptr(), "Rss") or 0) * 1024 >= nbytes
    _assert_matches_hf(loaded, tiny_model)


# In a fresh process (glibc's thresholds are process-wide): a 100 MiB buffer comes from the
# heap once the runtime is tuned, and stays resident after it is freed until trimmed.
HEAP_TRIM_SCRIPT = """
import torch
from pdserve.model import cpu_runtime
assert cpu_runtime.tune_cpu_runtime(), "glibc is not the allocator"
def anon_mib():
    line = next(l for l in open("/proc/self/status") if l.startswith("RssAnon"))
    return int(line.split()[1]) / 1024
buffer = torch.ones(100 * 2**20, dtype=torch.uint8)
held = anon_mib()
del buffer
freed = anon_mib()
cpu_runtime.release_free_heap()
print(held, freed, anon_mib())
"""


def test_release_free_heap_returns_what_the_tuned_heap_keeps():
    """The weights' first copies, freed after their gathering, must not stay resident in
    every worker (the trim threshold would keep them)."""
    run = subprocess.run(
        [sys.executable, "-c", HEAP_TRIM_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    held, freed, trimmed = (float(v) for v in run.stdout.split()[-3:])
    assert freed > held - 20 and trimmed < held - 80, (held, freed, trimmed)


def test_device_resolution():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ModelLoadError, match="device must be cpu, cuda or auto"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


def test_export_cli_reports_errors_without_traceback(tmp_path: Path, capsys):
    from pdserve.model.export_hf import main

    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 1
    assert "error: " in capsys.readouterr().err
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


# Run in a fresh process (oneDNN reads its cache sizes at first use): a float32 linear past the
# kernels' rows goes through oneDNN; each new row count is one more cache entry.
ONEDNN_GROWTH_SCRIPT = """
import sys, torch
from pdserve.model import cpu_runtime
from pdserve.model.layers import Linear
if sys.argv[1] == "tuned":
    cpu_runtime.ONEDNN_CACHE_CAPACITY = 8
    cpu_runtime.tune_cpu_runtime()
torch.set_num_threads(1)
layer = Linear(512, 1024, False, torch.float32, torch.device("cpu"))
layer.load(torch.randn(1024, 512))
layer.pack()
assert layer.onednn_weight is not None, "no oneDNN in this torch"
def anon_mib():
    line = next(l for l in open("/proc/self/status") if l.startswith("RssAnon"))
    return int(line.split()[1]) / 1024
with torch.inference_mode():
    for rows in range(40, 240):
        layer(torch.randn(rows, 512))
    start = anon_mib()
    for rows in range(240, 440):
        layer(torch.randn(rows, 512))
print(anon_mib() - start)
"""


def heap_growth_mib(setting: str) -> float:
    """RssAnon growth over the script's second 200 row counts, in a fresh process."""
    run = subprocess.run(
        [sys.executable, "-c", ONEDNN_GROWTH_SCRIPT, setting],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k},
    )
    assert run.returncode == 0, run.stderr
    return float(run.stdout.split()[-1])


def test_onednn_caches_stop_growing_once_the_runtime_is_tuned():
    """Prompts of every length keep a worker's heap flat after warm-up (a soak measured
    +540 MiB in 5 minutes before the caches were bounded); untuned, the same loop grows."""
    tuned, default = heap_growth_mib("tuned"), heap_growth_mib("default")
    assert tuned < 40 and default > 3 * tuned, (tuned, default)
