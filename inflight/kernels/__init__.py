"""The model's kernels: Triton on CUDA, native C (OpenMP) on the CPU, each beside its torch reference.

``reference.py`` is the specification and the fallback (the CPU runs it only where no native
kernel exists or the C library cannot be built); ``triton_*.py`` and ``cpu_native.py``
implement the same signatures; the bundle type (``KernelOps``) is the leaf
:mod:`inflight.kernels.ops`, and :mod:`inflight.kernels.dispatch` decides which bundle the
engine gets. Packed (quantized) weights have their own references, ``quant_reference.py``
(GGUF blocks) and ``intq_reference.py`` (compressed-tensors int4/int8), beside native
(``cpu_quant.py``, ``cpu_kquant.py``, ``cpu_intq.py``) and Triton (``triton_quant.py``,
``triton_intq.py``) kernels that ``dispatch.with_quantized_linear`` plugs into ``linear``;
``cpu_quant_q8.py`` is an integer-dot kernel that serving does not use. Each kernel has a
test comparing it with its reference.
"""
