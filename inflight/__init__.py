"""inflight: an in-flight batching LLM serving runtime and its Kubernetes operator.

Subpackages: ``inflight.runtime`` (engine, model, server), ``inflight.kernels`` (Triton
kernels with torch references), ``inflight.operator`` (the kopf operator).
"""

__version__ = "0.1.0"
