"""The scheduler's KV-connector hooks, driven by a scripted in-memory connector."""

from pdserve.core.config import CacheConfig, SchedulerConfig
from pdserve.core.kv_connector import KVConnectorScheduler, KVTransferEvents
from pdserve.core.request import FinishReason, RequestStatus
from pdserve.core.scheduler import Scheduler
from tests.core.helpers import MAX_MODEL_LEN, make_request, run_to_completion, step


class ScriptedConnector(KVConnectorScheduler):
    def __init__(self, recompute: bool = True, hold_finished: bool = False):
        self._recompute = recompute
        self.hold_finished = hold_finished
        self.remote: dict[str, int] = {}  # request id -> tokens available remotely
        self.loading: dict[str, list[int]] = {}
        self.events = KVTransferEvents()
        self.num_queries = 0
        self.admitted: list[tuple[str, int]] = []  # (request id, num_external_tokens)

    @property
    def recompute_on_failure(self):
        return self._recompute

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.num_queries += 1
        return max(self.remote.get(request.request_id, 0) - num_computed_tokens, 0)

    def update_state_after_alloc(self, request, num_external_tokens):
        self.admitted.append((request.request_id, num_external_tokens))
        self.remote.pop(request.request_id, None)  # decided once; a recompute runs locally
        if num_external_tokens:
            self.loading[request.request_id] = list(request.block_table)

    def request_finished(self, request):
        is_held = self.hold_finished or request.request_id in self.loading
        return is_held, {"held": request.request_id} if is_held else None

    def get_finished(self):
        events, self.events = self.events, KVTransferEvents()
        for request_id in events.finished_recving | events.failed_recving:
            self.loading.pop(request_id, None)
        return events


def _scheduler(connector, num_blocks=32):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN),
        CacheConfig(4, num_blocks),
        connector,
    )


def _remote_request(connector, name="r", num_prompt=10):
    request = make_request(name, num_prompt, max_tokens=3)
    request.output_token_ids = [555]  # the first token, sampled by the prefill worker
    connector.remote[name] = num_prompt
    return request


def test_remote_kv_skips_prefill_and_decodes_next_token():
    connector = ScriptedConnector()
    scheduler = _scheduler(connector)
    request = _remote_request(connector)
    scheduler.add_request(request)
    output, _ = step(scheduler)
    assert output.is_empty and request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(request.block_table) == 3
    connector.events.finished_recving.add("r")
    assert scheduler.update_kv_transfers().settled == [request]
    output, _ = step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("r", 1)]
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 32


def test_waiting_for_kv_does_not_block_other_requests():
    connector = ScriptedConnector()
    scheduler = _scheduler(connector)
    scheduler.add_request(_remote_request(connector))
    scheduler.add_request(make_request("local", 5, first_token=300))
    output, _ = step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["local"]


def test_failed_transfer_recomputes_locally():
    connector = ScriptedConnector(recompute=True)
    scheduler = _scheduler(connector)
    request = _remote_request(connector)
    scheduler.add_request(request)
    step(scheduler)
    connector.events.failed_recving.add("r")
    scheduler.update_kv_transfers()
    output, _ = step(scheduler)
    # Prompt plus the already-sampled first token are computed here.
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("r", 11)]
    run_to_completion(scheduler)
    assert request.finish_reason is FinishReason.LENGTH
    assert scheduler.block_manager.num_free_blocks == 32


def test_failed_transfer_fails_request_with_fail_policy():
    connector = ScriptedConnector(recompute=False)
    scheduler = _scheduler(connector)
    request = _remote_request(connector)
    scheduler.add_request(request)
    step(scheduler)
    connector.events.failed_recving.add("r")
    assert scheduler.update_kv_transfers().failed == [request]
    assert request.finish_reason is FinishReason.ERROR
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 32


def test_abort_while_receiving_holds_blocks_until_transfer_ends():
    connector = ScriptedConnector()
    scheduler = _scheduler(connector)
    scheduler.add_request(_remote_request(connector))
    step(scheduler)
    scheduler.abort_request("r")
    assert scheduler.block_manager.num_free_blocks < 32  # the receiver may still write
    connector.events.finished_recving.add("r")
    scheduler.update_kv_transfers()
    assert scheduler.block_manager.num_free_blocks == 32


def test_sender_holds_finished_blocks_until_released():
    connector = ScriptedConnector(hold_finished=True)
    scheduler = _scheduler(connector)
    request = make_request("p", 10, max_tokens=1)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 32 - 3
    assert request.kv_hand_off == {"held": "p"}  # what request_finished returned
    connector.events.finished_sending.add("p")
    scheduler.update_kv_transfers()
    assert scheduler.block_manager.num_free_blocks == 32


def test_remote_request_that_does_not_fit_waits_instead_of_recomputing():
    connector = ScriptedConnector()
    config = SchedulerConfig(max_num_batched_tokens=8, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(config, CacheConfig(4, 4), connector)
    scheduler.add_request(make_request("big", 8, max_tokens=3, first_token=300))
    step(scheduler)  # holds 2 of the 4 blocks
    # Its 10 tokens need 3 blocks; a 7-token local chunk would fit in 2, but must not be run.
    request = _remote_request(connector, num_prompt=10)
    scheduler.add_request(request)
    output, _ = step(scheduler)
    assert all(s.request is not request for s in output.scheduled)
    assert request.status is RequestStatus.WAITING and connector.loading == {}
    for _ in range(4):  # "big" finishes and frees its blocks: now the KV is fetched
        step(scheduler)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert request.request_id in connector.loading
    # Asked on every blocked step; told of the admission once.
    assert connector.num_queries >= 3
    assert [a for a in connector.admitted if a[0] == request.request_id] == [
        (request.request_id, 10)
    ]


def test_local_admissions_are_reported_with_no_external_tokens():
    connector = ScriptedConnector()
    scheduler = _scheduler(connector)
    request = _remote_request(connector, num_prompt=8)
    scheduler.add_request(make_request("local", 5, first_token=300))
    scheduler.add_request(request)
    step(scheduler)
    connector.events.finished_recving.add("r")
    scheduler.update_kv_transfers()
    run_to_completion(scheduler)
    # The received request re-enters as local work: told so, and never asked to fetch again.
    assert connector.admitted == [("local", 0), ("r", 8), ("r", 0)]
    assert request.kv_hand_off is None and request.finish_reason is FinishReason.LENGTH
