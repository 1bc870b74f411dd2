"""pdserve.router: the disaggregated-serving gateway.

- `pdserve router --prefill URL... --decode URL...` (`cli.add_parser` / `cli.run`): the
  OpenAI API of a worker in front of prefill and decode pools (`app.build_app`, with the
  server's front door `pdserve.api`), plus runtime scaling (``/workers``).
- Hand-off per docs/architecture.md: `dispatch.Dispatcher`; leg bodies and unclaimed KV in
  `handoff`; the decode stream in `relay`.
- Pure Python, shared with the simulator: policies (`policies`), workers and pools (`pool`),
  prompts and prefix beliefs (`prefix_index`).
- Prompt token ids: `tokenizer`. Health checks, circuit breaker, load scraping: `health`.
- Autoscaling: the pure decisions (`autoscale`, shared with the simulator), the planner loop
  and the fleet changes it makes, add / drain / switch pools (`autoscaler`).
- Timing breakdown and metrics: `timing`, `metrics`.
- The deployments that run a router beside their workers live in `pdserve.launch`.

Nothing here imports torch.
"""
