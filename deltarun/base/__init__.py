"""The base layer under both the graph families and the runtime core: errors, the ggml bindings and
helpers, the model file (GGUF reading, its vocabulary and chat template), and the family interface
with its registry.

Nothing here imports from the rest of deltarun (tests/test_layers.py checks it).
"""
