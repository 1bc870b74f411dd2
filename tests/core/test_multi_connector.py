"""`MultiConnector`: a disaggregated worker's transfer connector and a KV store's, as one."""

from pdserve.core.kv_connector import MultiConnector
from pdserve.core.request import RequestStatus
from tests.core.helpers import make_request, run_to_completion, step
from tests.core.test_scheduler_kv_connector import ScriptedConnector, _scheduler


def test_the_first_connector_offering_tokens_serves_the_request():
    transfer, store = ScriptedConnector(recompute=False), ScriptedConnector()
    scheduler = _scheduler(MultiConnector(transfer, store))
    remote = make_request("remote", 10, max_tokens=3)
    remote.output_token_ids = [555]
    stored = make_request("stored", 12, max_tokens=3, first_token=300)
    local = make_request("local", 5, first_token=600)
    transfer.remote["remote"] = 10
    store.remote.update({"remote": 8, "stored": 8})  # the transfer connector comes first
    for request in (remote, stored, local):
        scheduler.add_request(request)
    output, _ = step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["local"]
    assert remote.status is stored.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert ("remote", 10) in transfer.admitted and ("remote", 0) in store.admitted
    assert ("stored", 8) in store.admitted and ("stored", 0) in transfer.admitted
    assert not MultiConnector(transfer, store).recompute_on_failure  # the first one's policy
    transfer.events.finished_recving.add("remote")
    store.events.finished_recving.add("stored")
    assert {r.request_id for r in scheduler.update_kv_transfers().settled} == {"remote", "stored"}
    output, _ = step(scheduler)
    # The stored prompt computes only what the store did not hold.
    assert {(s.request.request_id, s.num_new_tokens) for s in output.scheduled} >= {("stored", 4)}
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 32


def test_finishing_asks_every_connector_and_keeps_the_hand_off():
    transfer, store = ScriptedConnector(hold_finished=True), ScriptedConnector()
    multi = MultiConnector(transfer, store)
    request = make_request("r", 4)
    assert multi.request_finished(request) == (True, {"held": "r"})
    transfer.events.finished_sending.add("r")
    store.events.finished_recving.add("s")
    events = multi.get_finished()
    assert events.finished_sending == {"r"} and events.finished_recving == {"s"}
