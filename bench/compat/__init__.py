"""``make compat`` (``python -m bench.compat.run``): outside clients (lm-eval, guidellm, the
openai client), each in its own venv (``envs``), against SmolLM2 served as ``make run`` serves it."""
