"""The model kinds, one package each: `batch` (dynamic batching for black-box models), `llm` (continuous
batching, its engine and models), `upstream` (relay to an OpenAI-compatible engine) and `search` (sharded,
replicated search). Each holds its front-end runtime, its worker side and its metrics. Beside them, what
knows every built-in kind: `builtin.py` (the Kind registry the server starts from), `repository.py` (model
folders and the built-in models) and `collectors.py` (every runtime's gauges at scrape time)."""
