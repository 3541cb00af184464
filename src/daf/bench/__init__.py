"""Benchmarks that a user runs as commands: ``daf bench memory`` (``python -m daf.bench memory``).

``memory``: the largest batch that trains under a RAM cap, for plain PyTorch, the recomputation
every PyTorch user already has, and DAF, each method in its own process (docs/benchmarks.md).
"""
