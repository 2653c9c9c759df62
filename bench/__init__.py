"""Experiments outside the ``inflight`` package: run from the repository root as modules.

* ``bench.studies``: one-off measurements behind figures quoted in ``docs/`` and
  ``bench/README.md`` (fairness, isolation, speculation, protocol codecs, process split, ...).
* ``bench.cpu``: CPU decode-step and attention timings with kernel variants side by side.
* ``bench.gpu``: ``make gpu-check`` (``python -m bench.gpu.check``) and its steps: Triton kernel
  checks and bench, the engine step against its roofline, a served burst, the compile check.
* ``bench.compat``: ``make compat``: lm-eval, guidellm and the openai client in their own venvs.

These import ``inflight`` (and the suite in ``inflight.bench``); nothing in ``inflight`` imports
them (``tests/test_import_graph.py``). Not shipped in the wheel or the images.
"""
