"""The ``spec.engine`` part of the InferenceDeployment CRD, generated from EngineConfig.

Owns the engine properties' schemas (types, help texts, choices, CEL rules for fractions, the
integer bounds the runtime enforces, which fields are live-tunable) and ``speculative``'s, so
the CRD can never drift from the runtime's knobs. ``crd`` assembles it with the rest
(``crd_parts``). Pure; knows nothing about Kubernetes I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator import crd_parts, engine_args
from inflight.runtime.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LIVE_TUNABLE_FIELDS,
    MAX_CONFIG_INT,
    QUANTIZATIONS,
    SCHEDULER_POLICIES,
)

CHOICES = {"dtype": DTYPES, "scheduler_policy": SCHEDULER_POLICIES, "quantization": QUANTIZATIONS,
            "kv_cache_dtype": KV_CACHE_DTYPES}
FRACTION_RULE = {"rule": "self > 0.0 && self <= 1.0", "message": "must be in (0, 1]"}


def _engine_property(name: str) -> dict[str, Any]:
    field = engine_args.engine_fields()[name]
    type_name = str(field.type).split("|")[0].strip()  # "int | None" -> "int"
    prop: dict[str, Any] = {"description": field.metadata.get("help", "")}
    if name in LIVE_TUNABLE_FIELDS:
        prop["description"] += " Live-tunable: changing it does not restart pods."
    if name == "speculative_config":
        return _speculative_property()
    if type_name == "bool":
        prop["type"] = "boolean"
    elif type_name == "int":
        # The runtime refuses integers above MAX_CONFIG_INT; the API server refuses them first.
        prop.update(type="integer", minimum=0 if name == "max_queue_len" else 1, maximum=MAX_CONFIG_INT)
    elif type_name == "float":
        prop.update(type="number", **{"x-kubernetes-validations": [crd_parts.NUMBER_RULES.get(name, FRACTION_RULE)]})
    else:
        prop.update(type="string", enum=list(CHOICES[name]))
    return prop


def _speculative_property() -> dict[str, Any]:
    """An object with vLLM's ``--speculative-config`` keys (rendered as that flag's JSON)."""
    from inflight.runtime.spec_decode.speculative import METHODS

    def count(doc: str, maximum: int | None = None) -> dict[str, Any]:
        return {"type": "integer", "minimum": 1, "description": doc, **({"maximum": maximum} if maximum else {})}

    return {
        "type": "object",
        "description": "Speculative decoding, with vLLM's --speculative-config keys (rendered as that "
                       "flag's JSON). Off when unset.",
        "properties": {
            "method": {"type": "string", "enum": list(METHODS),
                       "description": "ngram: prompt lookup; draft_model: a small model (model) proposes; "
                                      "eagle3: an EAGLE-3 head (model) proposes from the served model's hidden "
                                      "states; mtp: the served DeepSeek-V3 / GLM-4.5 checkpoint's own "
                                      "multi-token-prediction layer proposes (no model)."},
            "model": {"type": "string", "description": "draft_model / eagle3: the draft model's or head's directory "
                                                       "in the runtime container (mount it beside the model); a "
                                                       "draft model must share the served model's tokenizer."},
            "num_speculative_tokens": count("Draft tokens proposed per step.", 16),
            "prompt_lookup_max": count("Longest n-gram looked up."),
            "prompt_lookup_min": count("Shortest n-gram looked up."),
            "disable_by_batch_size": count("No speculation while this many sequences or more run."),
        },
    }


def engine_schema() -> dict[str, Any]:
    props = {engine_args.snake_to_camel(n): _engine_property(n) for n in engine_args.CR_ENGINE_FIELDS}
    props["extraArgs"] = {
        "type": "array",
        "items": {"type": "string"},
        "description": "More runtime CLI flags, appended verbatim (changing them rolls the pods).",
    }
    tokens = engine_args.default_of("max_num_tokens")
    return {
        "type": "object",
        "description": "Engine knobs (EngineConfig fields in camelCase). Unset ones take the runtime's defaults.",
        "properties": props,
        "x-kubernetes-validations": [{
            "rule": "!has(self.maxModelLen) || !has(self.enableChunkedContext) || self.enableChunkedContext"
                    f" || (has(self.maxNumTokens) ? self.maxNumTokens : {tokens}) >= self.maxModelLen",
            "message": "with enableChunkedContext false, maxNumTokens must be >= maxModelLen",
        }],
    }
