"""The names of a worker's Prometheus metrics that the router reads from its ``/metrics``:
the server exports them (`server.metrics`), routing reads the gauges (`router.health`) and the
autoscaler the histograms and busy time (`router.autoscale.loop`). Named `pdserve:*` after
vLLM's `vllm:*`."""

RUNNING_GAUGE = "pdserve:num_requests_running"
WAITING_GAUGE = "pdserve:num_requests_waiting"
KV_USAGE_GAUGE = "pdserve:kv_cache_usage_perc"
TTFT_HISTOGRAM = "pdserve:time_to_first_token_seconds"
ITL_HISTOGRAM = "pdserve:inter_token_latency_seconds"
STEP_TIME_HISTOGRAM = "pdserve:engine_step_time_seconds"
# Seconds the engine has spent in steps since it started: the step histogram's sum.
BUSY_SECONDS = f"{STEP_TIME_HISTOGRAM}_sum"
