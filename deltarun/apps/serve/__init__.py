"""`deltarun serve`: an OpenAI-compatible HTTP server with parallel sequences and a hybrid-aware prompt cache.

Modules, each with one job:

- `protocol`: OpenAI request bodies checked into dataclasses; response objects; `ApiError`.
- `prompts`: a checked request -> tokens, limits, grammar and checkpoint positions (`GenParams`).
- `output`: generated tokens -> content / reasoning_content / tool_calls deltas, stop strings.
- `grammar`: llguidance token masks for `response_format` and forced tool calls.
- `worker`: the thread that owns the Model and schedules every sequence (continuous batching).
- `prompt_cache`: which saved state (a live seq, a checkpoint, host RAM) each request resumes from.
- `metrics`: Prometheus counters and gauges.
- `app`: the Starlette routes; `server`: wiring and uvicorn with a clean SIGTERM.
"""
