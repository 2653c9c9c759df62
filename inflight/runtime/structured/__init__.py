"""Structured outputs: grammar-constrained decoding with llguidance.

``params`` holds the request-side value (what the client asked for, canonicalized);
``manager`` compiles grammars once (bounded cache, worker pool) and hands each request its own
matcher; ``bitmask`` applies the matchers' token masks to the batch's logits in the sampler.
"""

from inflight.runtime.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
