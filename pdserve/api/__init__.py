"""pdserve.api: the OpenAI front door the server (`pdserve.server`) and the router
(`pdserve.router`) share, so both answer the same request the same way.

- `errors`: the one error envelope (`APIError`, `ErrorType` with its statuses), pydantic
  validation errors phrased as a 400 naming the field, the exception handlers.
- `protocol`: the request bodies (pydantic, strict) and the chat messages as a template takes
  them (`template_messages`: "developer" spelled "system").
- `asgi`: `install_front_door` (handlers + Bearer-key or fleet-signature and body-size
  guards), the client-disconnect watcher `until_disconnected`, `ManagedStreamingResponse`
  (always cleans up), SSE framing.
- `signing`: fleet request signatures (the router's `FleetAuth`, the worker's check and its
  `ReplayGuard`): the fleet secret never on the wire.

Nothing here imports torch.
"""
