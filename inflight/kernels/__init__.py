"""The model's kernels: Triton on CUDA, native C (OpenMP) on the CPU, each beside its torch reference.

``reference.py`` is the specification and the fallback; ``triton_*.py`` and ``cpu_native.py``
implement the same signatures; :mod:`inflight.kernels.dispatch` decides which bundle
(``KernelOps``) the engine gets. Each kernel has a test comparing it with its reference.
"""
