"""``make gpu-check`` (``python -m bench.gpu.check``) and its steps: ``checks`` (each Triton kernel
against its reference), ``kernels`` (kernel bench), ``engine`` (the engine step against its
roofline), ``burst`` (a served burst), ``compile_check``, ``report``; ``timing`` is their shared leaf."""
