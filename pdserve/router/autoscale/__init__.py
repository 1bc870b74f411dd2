"""The router's autoscaler: each pool sized on its own signal.

The decisions are pure Python (signals in, decisions out: no clock, no I/O, no torch), so the
router's planner loop (`loop`) and `pdserve simulate --autoscale` (`sim.autoscale`) run the
same `planner.AutoscaleController` on the same `signals.WorkerSample`s and decide alike.

- `config`: `AutoscaleConfig` (bounds, targets, pace) and the `--slo` targets (`SLO`);
- `histogram`: Prometheus histograms as the planner reads them (bucket deltas, quantiles);
- `signals`: one `WorkerSample` per worker per tick, summed into each pool's `PoolSignals`;
- `planner`: each pool's pressure and the change to make, as an ordered list of named rules;
- `loop`: the live side: `FleetActions` (add, drain and stop, switch a worker) and the
  `Autoscaler` that scrapes every worker's /metrics each interval and makes the change.
"""
