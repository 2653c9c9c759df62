"""Test-only fault injection for grammars: a compile or a token mask that stalls on demand.

``INFLIGHT_TEST_GRAMMAR_FAULT=slow-compile:MARKER`` makes compiling any constraint whose text
contains ``MARKER`` stall; ``slow-mask:MARKER`` makes every token mask of such a constraint
stall. A stall lasts until the structured-output manager releases it (``close`` or
``release_stalls``), at most ``STALL_CAP_S``, so the compile deadline and the mask deadline
can be tested without a grammar that is really slow and without racing a clock. Never set it
in production. Knows nothing about llguidance, the engine or HTTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from inflight import env_vars
from inflight.runtime.structured.params import StructuredOutputsParams

logger = logging.getLogger("inflight.structured")

GRAMMAR_FAULT_ENV = "INFLIGHT_TEST_GRAMMAR_FAULT"
STALL_CAP_S = 60.0  # an injected stall never outlives a test run
KINDS = ("slow-compile", "slow-mask")


@dataclass(frozen=True, slots=True)
class GrammarFault:
    """Stall the ``kind`` work of every constraint whose spec contains ``marker``."""

    kind: str
    marker: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS or not self.marker:
            raise ValueError(f"{GRAMMAR_FAULT_ENV} must be slow-compile:MARKER or slow-mask:MARKER "
                             f"(got {self.kind}:{self.marker})")

    def stalls(self, kind: str, params: StructuredOutputsParams) -> bool:
        return kind == self.kind and self.marker in params.spec


def parse_grammar_fault(spec: str) -> GrammarFault | None:
    """``slow-compile:MARKER`` / ``slow-mask:MARKER`` -> a fault; ``""`` -> None."""
    if not spec:
        return None
    kind, _, marker = spec.partition(":")
    fault = GrammarFault(kind, marker)
    logger.warning("%s=%s: grammar fault injection is on (tests only)", GRAMMAR_FAULT_ENV, spec)
    return fault


def grammar_fault_from_env() -> GrammarFault | None:
    return parse_grammar_fault(env_vars.read_str(GRAMMAR_FAULT_ENV) or "")
