"""Attention, KV-cache and normalization kernels: Triton on CUDA, torch references elsewhere.

The engine calls only the dispatching functions exported here; which implementation runs is
decided by :mod:`inflight.kernels.dispatch`.
"""
