"""Speculative decoding: the config (vLLM's ``--speculative-config``) and the n-gram proposer.

Two methods propose the drafts. Prompt lookup (``"method": "ngram"``): the last ``n`` tokens
of a sequence (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
in the sequence's own earlier tokens, and the ``num_speculative_tokens`` tokens that followed
the latest earlier occurrence are proposed; each sequence keeps an index from every n-gram to
where its latest earlier occurrence continues, updated as tokens are added, so a proposal
costs a few dictionary lookups. A draft model (``"method": "draft_model"``, ``"model": DIR``;
as in vLLM, ``"model"`` without ``"method"`` means a draft model): a small model sharing the
target's vocabulary proposes them (:mod:`inflight.runtime.spec_decode.draft_proposer`). An EAGLE-3 head
(``"method": "eagle3"``, ``"model": DIR``) proposes them from the target's own hidden states
(:mod:`inflight.runtime.spec_decode.eagle3`); EAGLE-1/2 heads (``"eagle"``) are refused. The served
model's own multi-token-prediction layers (``"method": "mtp"``, no ``"model"``: DeepSeek-V3's and GLM-4.5's
``num_nextn_predict_layers``; vLLM's older spellings ``"deepseek_mtp"``, ``"glm4_moe_mtp"`` and
``"qwen3_next_mtp"`` read as ``"mtp"``) propose them the same way (:mod:`inflight.runtime.spec_decode.mtp`).
Either way the proposals ride in the normal batch as extra query tokens of the sequence (see the
scheduler) and the engine keeps what the target model agrees with (:mod:`inflight.runtime.spec_decode.verify`).
Imports no torch; knows nothing about the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
MODEL_METHODS = ("draft_model", "eagle3", "mtp")  # drafts proposed by a model before the target's forward
# vLLM's per-family names of MTP speculation (older releases; "mtp" now): the served model says the family
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp")
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM's spelling of n-gram as a "model"
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Parsed ``--speculative-config``; invalid values raise ``ValueError``."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Speculation pays while decode is bound by reading the weights; with this many running
    # sequences or more the batch already amortizes them, and a step speculates for none.
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft model's directory (it shares the target's tokenizer)

    def __post_init__(self) -> None:
        if self.method == "eagle":
            raise ValueError('speculative method "eagle" (EAGLE-1/2 heads) is not served; EAGLE-3 heads are: '
                             '{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}')
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)} (got {self.method!r}).")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError('speculative method "draft_model" needs "model": the directory of a draft model '
                             "that shares the target's tokenizer, e.g. "
                             '{"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 4}')
        if self.method == "eagle3" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError('speculative method "eagle3" needs "model": the directory of an EAGLE-3 head trained '
                             'for the served model, e.g. {"method": "eagle3", "model": "/models/EAGLE3-LLaMA3.1-'
                             'Instruct-8B", "num_speculative_tokens": 3}')
        if self.method == "mtp" and self.model is not None:
            raise ValueError(f'speculative method "mtp" reads the served model\'s own multi-token-prediction layers; '
                             f'"model" ({self.model!r}) is not used: leave it out, e.g. '
                             '{"method": "mtp", "num_speculative_tokens": 1}')
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f'speculative "model" ({self.model!r}) names a draft model, which method "ngram" '
                             'does not use; use "method": "draft_model" or leave "model" out')
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("disable_by_batch_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative {name} must be an integer >= {low} (got {value!r}).")
        if isinstance(self.prompt_lookup_max, bool) or not isinstance(self.prompt_lookup_max, int) or (
                self.prompt_lookup_max < self.prompt_lookup_min):
            raise ValueError(f"speculative prompt_lookup_max must be an integer >= prompt_lookup_min "
                             f"(got {self.prompt_lookup_max!r}).")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative num_speculative_tokens must be <= 16 (got {self.num_speculative_tokens}).")


def draft_states(spec: SpeculativeConfig | None, max_num_sequences: int) -> tuple[int, int]:
    """(the most rows that speculate in one step, drafts a row): a step speculates only while fewer
    than ``disable_by_batch_size`` run. A hybrid model keeps scratch states for them (worker/hybrid_cache.py)."""
    if spec is None:
        return (0, 0)
    return (min(max_num_sequences, spec.disable_by_batch_size - 1), spec.num_speculative_tokens)


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON (vLLM's keys) -> the config; None when not given."""
    if text is None or not text.strip():
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if raw.get("model") in NGRAM_MODEL_NAMES and raw.get("method", "ngram") == "ngram":
        raw = {**raw, "method": "ngram", "model": None}
    elif "method" not in raw and raw.get("model") is not None:  # vLLM: a model without a method is a draft
        raw = {**raw, "method": "draft_model"}
    elif raw.get("method") in MTP_ALIASES:
        raw = {**raw, "method": "mtp"}
    return SpeculativeConfig(**raw)


@dataclass(slots=True)
class SpecStats:
    """Cumulative acceptance counters (vLLM's spec-decode metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass(slots=True)
class NgramIndex:
    """Per sequence: n-gram -> the position right after its latest occurrence whose next
    token is known (the sequence's own suffix is therefore never its own match)."""

    min_n: int
    max_n: int
    next_pos: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in the index

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (``max_n`` down to ``min_n`` tokens); [] when none matches."""
        end = len(token_ids)
        # Index every n-gram whose next token is known: those ending before the last token.
        for stop in range(max(self.indexed, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self.next_pos[tuple(token_ids[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            pos = self.next_pos.get(tuple(token_ids[end - n : end]))
            if pos is not None:
                return token_ids[pos : pos + k]
        return []
