"""pdserve.launch: how `pdserve serve` is deployed, as one process or as a fleet of them.

- `cli`: the `serve` command: its flags (server, engine, KV transfer, disaggregation,
  routing), which of them each worker is started with (`WORKER_FLAGS`), and the choice
  between one server (`--mode colocated|chunked`) and a disaggregated deployment.
- `local`: the one-host deployment of `--mode disagg`: prefill and decode workers pinned to
  their own cores, the router in the launching process; `LocalProvisioner`, the one-host
  `provision.Provisioner` through which the router's autoscaler starts and stops workers.
- `provision`: the `Provisioner` interface every deployment target implements.
- `worker_group`: worker processes: start pinned, wait until healthy, stop.

Nothing here imports torch: the launching process runs the router.
"""
