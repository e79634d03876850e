"""Graph families, one per `general.architecture`: qwen3next, qwen35, qwen35moe.

Each family is a class following `deltarun.base.interface.GraphFamily`, registered in the
`deltarun.graphs` entry-point group (pyproject.toml) and found by `deltarun.base.registry`; the
runtime core never imports this package. A family is one file built from the shared blocks
(blocks/, family.py) and the file checks (spec.py); graphs/ imports nothing of deltarun but
itself and `deltarun.base`.
"""
