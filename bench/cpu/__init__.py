"""CPU kernel and decode-step timings (``python -m bench.cpu.step``, ``bench.cpu.attention``,
``bench.cpu.prefill``)."""
