"""The device side of a step: the model runner, batch inputs packed from the scheduler's output,
logit rows, the sampler, CUDA graphs and their CPU stand-in, the step worker; ``worker.cpu`` holds
the CPU executor's policy (threads, decode lanes, the allocator). Imports from the core only the
plain-data scheduler output (``core.sched_output``), and never the live ``Request``, not even as a
type (tests/test_import_graph.py).
"""
