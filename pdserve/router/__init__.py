"""pdserve.router: the disaggregated-serving gateway and the one-command launcher.

- `pdserve router --prefill URL... --decode URL...` (`cli.add_parser` / `cli.run`): the
  OpenAI API of a worker in front of prefill and decode pools (`app.build_app`).
- Hand-off per docs/architecture.md: `dispatch.Dispatcher`; bodies in `legs`.
- Policies (pure Python, shared with the simulator): `policies`; prefix beliefs:
  `prefix_index`.
- Health checks and circuit breaker: `health`; runtime scaling: `workers_api`.
- Timing breakdown and metrics: `timing`, `metrics`.
- `pdserve serve --mode disagg`: `launcher.add_disagg_args` / `launcher.launch_disagg`.

Nothing here imports torch.
"""
