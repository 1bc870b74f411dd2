"""pdserve.launch: how `pdserve serve` is deployed, as one process or as a fleet of them.

- `cli`: the `serve` command: its flags (server, engine, KV transfer, disaggregation,
  routing) and the choice between one server (`--mode colocated|chunked`) and a
  disaggregated deployment.
- `deployment`: what every disaggregated deployment shares: which flags each worker is
  started with (`WORKER_FLAGS`), the pools' initial sizes, `run_deployment` (the router in
  the launching process until SIGINT/SIGTERM).
- `local`: the one-host deployment of `--mode disagg`: prefill and decode workers pinned to
  their own cores; `LocalProvisioner`, the one-host `router.provision.Provisioner` through
  which the router's autoscaler starts and stops workers.
- `ray_cluster`: the same deployment as Ray actors across a cluster (`RayProvisioner`).
- `worker_group`: worker processes: start pinned, wait until healthy, stop.

Nothing here imports torch: the launching process runs the router.
"""
