"""The hand-off schema: round trip, strict validation, versioning, layout compatibility."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.kv_transfer import (
    KV_TRANSFER_PROTOCOL_VERSION,
    KVIncompatibleError,
    KVLayout,
    KVProtocolError,
    KVTransferParams,
    check_compatible,
)
from tests.kv_transfer.helpers import tiny_layout

SMOLLM2 = KVLayout(
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    block_size=16,
    dtype="bfloat16",
)


def _hand_off(**overrides) -> dict:
    data = {
        "do_remote_prefill": True,
        "remote_engine_id": "e1",
        "remote_request_id": "r1",
        "remote_host": "10.0.0.2",
        "remote_port": 7100,
        "remote_block_ids": [3, 4, 9],
        "remote_num_tokens": 40,
        "transport": "tcp",
        "layout_hash": SMOLLM2.layout_hash(),
        "protocol_version": KV_TRANSFER_PROTOCOL_VERSION,
        "first_token_id": 42,
    }
    data.update(overrides)
    return data


def test_hand_off_round_trips_through_json_dict():
    params = KVTransferParams.from_dict(_hand_off())
    assert params.remote_block_ids == (3, 4, 9)
    assert KVTransferParams.from_dict(params.to_dict()) == params
    assert params.to_dict()["remote_block_ids"] == [3, 4, 9]


def test_prefill_leg_needs_only_do_remote_decode():
    params = KVTransferParams.from_dict({"do_remote_decode": True})
    assert params.do_remote_decode and not params.do_remote_prefill


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"remote_port": "7100"}, "kv_transfer_params.remote_port must be an integer"),
        ({"remote_port": 70000}, "kv_transfer_params.remote_port must be in"),
        ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill must be a boolean"),
        ({"remote_block_ids": [1, "2"]}, "kv_transfer_params.remote_block_ids[] must be an int"),
        ({"remote_block_ids": [1, True]}, "kv_transfer_params.remote_block_ids[] must be an int"),
        ({"remote_block_ids": [1, 1]}, "remote_block_ids has duplicates"),
        ({"remote_block_ids": []}, "remote_block_ids must name at least one block"),
        ({"remote_host": None}, "kv_transfer_params.remote_host is required"),
        ({"transport": "rdma"}, "kv_transfer_params.transport must be one of"),
        ({"transport": "shm"}, "kv_transfer_params.shm_name is required"),
        ({"do_remote_decode": True}, "exclusive"),
        ({"surprise": 1}, "unknown field(s): surprise"),
        ({"first_token_id": -1}, "kv_transfer_params.first_token_id must be in"),
    ],
)
def test_bad_params_name_the_field(overrides, field):
    with pytest.raises(KVProtocolError) as info:
        KVTransferParams.from_dict(_hand_off(**overrides))
    assert field in str(info.value)


def test_params_must_be_an_object():
    with pytest.raises(KVProtocolError, match="must be a JSON object"):
        KVTransferParams.from_dict(["do_remote_decode"])


def test_unknown_protocol_version_is_refused_clearly():
    with pytest.raises(KVIncompatibleError) as info:
        KVTransferParams.from_dict(_hand_off(protocol_version=KV_TRANSFER_PROTOCOL_VERSION + 1))
    message = str(info.value)
    assert f"version {KV_TRANSFER_PROTOCOL_VERSION + 1} is not supported" in message
    assert f"speaks version {KV_TRANSFER_PROTOCOL_VERSION}" in message


def test_decode_leg_must_state_its_version():
    with pytest.raises(KVProtocolError, match="protocol_version is required"):
        KVTransferParams.from_dict(_hand_off(protocol_version=None))


def test_layout_hash_is_stable_across_processes_and_sensitive_to_every_field():
    code = (
        "from pdserve.kv_transfer import KVLayout; print(KVLayout('HuggingFaceTB/SmolLM2-"
        "135M-Instruct', 30, 3, 64, 16, 'bfloat16').layout_hash())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert other.stdout.strip() == SMOLLM2.layout_hash()
    variants = [
        tiny_layout(),
        tiny_layout("bfloat16"),
        tiny_layout(model_id="x"),
        tiny_layout(num_layers=5),
        tiny_layout(num_kv_heads=1),
        tiny_layout(head_dim=16),
        tiny_layout(block_size=8),
    ]
    assert len({layout.layout_hash() for layout in variants}) == len(variants)


def test_layout_sizes():
    assert SMOLLM2.block_nbytes == 16 * 3 * 64 * 2
    assert SMOLLM2.num_blocks_for(3000) == 188
    assert SMOLLM2.nbytes(188) == 30 * 2 * 188 * 6144


def test_compatibility_check_names_each_difference():
    check_compatible(SMOLLM2, SMOLLM2)
    remote = KVLayout(
        "other", num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32"
    )
    with pytest.raises(KVIncompatibleError) as info:
        check_compatible(SMOLLM2, remote, remote_version=KV_TRANSFER_PROTOCOL_VERSION + 1)
    assert [d.split(" (")[0] for d in info.value.differences] == [
        "protocol version differs",
        "model differs",
        "dtype differs",
        "block layout differs",
    ]
    assert "block_size local 16 remote 32" in str(info.value)


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        ({**SMOLLM2.to_dict(), "dtype": "int8"}, "dtype must be one of"),
        ({**SMOLLM2.to_dict(), "num_layers": 0}, "num_layers must be in"),
        ({**SMOLLM2.to_dict(), "extra": 1}, "unknown field(s): extra"),
        ("layout", "must be a JSON object"),
    ],
)
def test_bad_layout_is_refused(data, phrase):
    with pytest.raises(KVProtocolError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        KVLayout.from_dict(data)


def test_schema_modules_do_not_import_torch():
    code = (
        "import sys; import pdserve.kv_transfer, pdserve.kv_transfer.wire; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
