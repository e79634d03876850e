"""The runtime core: GGUF loading, weights, backends and the scheduler, memory (KV cache and
rollback-slot recurrent state), the model, the tokenizer, sampling and the decode loop.

Nothing here imports from `deltarun.apps` or `deltarun.cli`; graphs come in through the
`deltarun.graphs` interface.
"""
