"""Cluster simulator and capacity planner over pdserve's own scheduling code.

A discrete-event simulation (`simulator`) runs the real `pdserve.core` scheduler, block
manager and KV-connector interface per worker (`worker`, `connector`), and the real
`pdserve.router` pools, policies, leases and prefix index (`router`), with a physical cost
model (`cost_model`) in place of the forward pass and a fair-share link model (`transfers`)
for KV transfers. Results are `pdserve.workload` records and metrics (`report`), so simulated
and measured runs read the same way.

- Catalogs: `hardware`, `network`, `model_spec` (plus any Hugging Face config.json).
- Fitting to the real engine: `measure` (engine step times), `calibration` (the fit),
  `efficiency` (the fitted factors, saved as JSON).
- Planning: `layout` (a layout family at any size), `planner` (search, capacity, inverse
  question), `plan_report` (table, reasoning, goodput-vs-split plot).
- `claims` regenerates docs/claims.md; `cli` wires `pdserve simulate [calibrate]` and
  `pdserve plan`.

What is not modelled: prefill/transfer overlap (KV moves after the prefill leg finishes, as
pdserve's connector does today), HTTP and tokenization time, the prefill worker's lease
timeout, KV transfer failures, and contention between co-located CPU workers for memory
bandwidth beyond what calibration captured.
"""
