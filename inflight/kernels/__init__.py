"""The model's kernels: Triton on CUDA, native C (OpenMP) on the CPU, each beside its torch reference.

``reference.py`` is the specification and the fallback; ``triton_*.py`` and ``cpu_native.py``
implement the same signatures; the bundle type (``KernelOps``) is the leaf
:mod:`inflight.kernels.ops`, and :mod:`inflight.kernels.dispatch` decides which bundle the
engine gets. Each kernel has a test comparing it with its reference.
"""
