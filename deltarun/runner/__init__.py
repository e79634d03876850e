"""The runtime core: devices, backends, layer placement and the scheduler, weights, memory (KV cache
and rollback-slot recurrent state), the resume planner, the model, sampling and the decode loop.

It imports only `deltarun.base` (errors, ggml, the GGUF file and its tokenizer): a file's graph
family is found at run time through `deltarun.base.registry` and used through
`deltarun.base.interface`, never imported from `deltarun.graphs`.
"""
