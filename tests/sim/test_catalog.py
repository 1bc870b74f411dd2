import json

import pytest

from pdserve.sim.errors import SimConfigError
from pdserve.sim.hardware import get_hardware
from pdserve.sim.model_spec import MODELS, load_model_spec
from pdserve.sim.network import ASSUMED_EFFICIENCY, get_network


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("Llama-3-70B", 80 * 8 * 128 * 2 * 2),  # 327,680
        ("Llama-3.1-8B", 32 * 8 * 128 * 2 * 2),  # 131,072
        ("Qwen2.5-7B", 28 * 4 * 128 * 2 * 2),  # 57,344
        ("SmolLM2-135M", 30 * 3 * 64 * 2 * 2),  # 23,040
    ],
)
def test_kv_bytes_per_token(name, kv_bytes):
    assert MODELS[name].kv_bytes_per_token("bf16") == kv_bytes
    assert MODELS[name].kv_bytes_per_token("fp8") == kv_bytes // 2


@pytest.mark.parametrize(
    ("name", "num_params"),
    [
        # Hand sums of embedding, per-layer q/k/v/o + gate/up/down + 2 norms, final norm, head.
        ("Llama-3-70B", 70_553_706_496),
        ("Llama-3.1-8B", 8_030_261_248),
        ("SmolLM2-135M", 134_515_008),  # tied embeddings: no separate LM head
    ],
)
def test_num_params(name, num_params):
    assert MODELS[name].num_params == num_params


def test_hf_config_json_loads(tmp_path):
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_model_spec(str(tmp_path))
    assert spec.head_dim == 16
    assert spec.kv_bytes_per_token() == 2 * 2 * 16 * 2 * 2


def test_hf_config_missing_field_names_it(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SimConfigError, match="num_attention_heads"):
        load_model_spec(str(path))


def test_unknown_names_list_the_catalog():
    with pytest.raises(SimConfigError, match="H100-SXM"):
        get_hardware("TPU-v9")
    with pytest.raises(SimConfigError, match="ib-400"):
        get_network("carrier-pigeon")
    with pytest.raises(SimConfigError, match="SmolLM2-135M"):
        load_model_spec("no-such-model")


def test_lookup_aliases_and_numeric_network():
    assert get_hardware("h100").name == "H100-SXM"
    assert get_network("IB-400").bandwidth == 50e9
    assert get_network("200").bandwidth == 25e9
    assert get_network("ib-8x400").node_bandwidth == pytest.approx(400e9 * ASSUMED_EFFICIENCY)


def test_fp8_missing_on_a100():
    with pytest.raises(SimConfigError, match="FP8"):
        get_hardware("A100-80GB").peak_flops("fp8")
