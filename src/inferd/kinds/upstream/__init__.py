"""The `upstream` kind: requests relayed to OpenAI-compatible engines. `runtime.py` (UpstreamRuntime),
`pool.py` (UpstreamPool: which engine takes a request), `reply.py` (what an engine's reply means),
`metrics.py`."""
