import pytest

from pdserve.core.config import Mode
from pdserve.sim.model_spec import MODELS
from pdserve.sim.simulator import simulate
from tests.sim.helpers import azure_trace, make_config


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "pools"),
    [(Mode.CHUNKED, {"num_workers": 8}), (Mode.DISAGG, {"num_prefill": 2, "num_workers": 6})],
)
def test_ten_minutes_of_1000_requests_on_64_gpus_in_under_a_minute(mode, pools):
    specs = azure_trace(1000, 1000 / 600)  # trace lengths, 10 minutes of arrivals
    config = make_config(
        mode, tp=8, budget=2048, max_num_seqs=256, model=MODELS["Llama-3-70B"], **pools
    )
    assert config.num_devices == 64
    result = simulate(config, specs)
    assert result.duration_s > 590
    assert all(r.success for r in result.records)
    assert result.wall_time_s < 60
