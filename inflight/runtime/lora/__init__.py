"""Multi-LoRA serving (issue 49): PEFT adapters read, checked, kept as host copies and in device slots.

Modules: ``types`` (the vocabulary the server and operator share; no torch), ``peft_format``
(reading and checking a PEFT directory against the served model), ``slots`` (the device slots
each decoder layer reads its deltas from, this rank's shard), ``registry`` (names, load ids,
host copies and slot assignment, LRU both). The engine's methods are
:mod:`inflight.runtime.core.engine_lora`; the scheduler's slot limit :mod:`inflight.runtime.core.lora_gate`.
Importing the package imports nothing heavy.
"""
