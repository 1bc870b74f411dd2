"""Server fixtures: real `pdserve serve` subprocesses on free ports, stopped with SIGTERM.

Two models: the default SmolLM2 (real weights: finish reasons and text are meaningful) and a
tiny random-weight Llama with SmolLM2's tokenizer, written to a Hugging Face folder (each step
takes about a millisecond, for fuzzing, overload and shutdown tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.gguf_file import GGUFModelFile
from pdserve.model.llama import hf_weight_shapes
from pdserve.model.loader import default_model_path
from pdserve.ports import free_port

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180.0
NUM_KV_BLOCKS = 256


@dataclasses.dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples as {"name{label=value,...}": value} (labels sorted, model_name dropped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)


def start_server(log_dir: Path, *args: str, api_key: str | None = None) -> ServerProcess:
    """Start `pdserve serve` and wait until /health answers 200."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "--log-level",
        "INFO",
        "serve",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        *args,
    ]
    if api_key:
        command += ["--api-key", api_key]
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a starting process; nothing is being simulated
    server.stop()
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def write_tiny_model(out_dir: Path, **shape) -> Path:
    """A 2-layer, 64-wide Llama with random weights and SmolLM2's tokenizer and template
    (`shape`: other config fields, e.g. a wider one whose steps outlast timer noise)."""
    gguf = GGUFModelFile(default_model_path())
    tiny = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    config = dataclasses.replace(gguf.config, **{**tiny, **shape})
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in hf_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * 0.2
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_config()))
    gguf.tokenizer().save_hf(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def tiny_engine(model_dir: Path) -> LLMEngine:
    """An in-process engine over the tiny model (256-token context), for `create_app`."""
    return LLMEngine.from_args(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=256,
        num_threads=1,
    )


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory):
    """The default model, chunked prefill, API key required."""
    server = start_server(tmp_path_factory.mktemp("smol"), "--max-num-seqs", "16", api_key=API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_model_dir):
    """The tiny random model, no API key, short context."""
    server = start_server(
        tmp_path_factory.mktemp("tiny"),
        "--model",
        str(tiny_model_dir),
        "--max-model-len",
        "256",
        "--served-model-name",
        "tiny",
        "tiny-alias",
    )
    yield server
    server.stop()
