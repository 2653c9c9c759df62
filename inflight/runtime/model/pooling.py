"""How a pooling model turns a prompt's hidden states into one vector: ``PoolerConfig``.

Owns the runner choice (``EngineConfig.runner``: ``auto`` serves a checkpoint with no LM head,
``*Model`` or ``*ForSequenceClassification``, with the pooling runner, anything else with the
generate runner), ``--pooler-config`` (vLLM's JSON object: ``pooling_type`` LAST, MEAN or CLS,
``normalize``; and ``is_matryoshka`` / ``matryoshka_dimensions``, which vLLM reads from the model
config, for checkpoints that do not say so themselves), and the defaults a checkpoint brings:
sentence-transformers' ``modules.json`` (a ``Pooling`` module's ``config.json``: which pooling
mode; a ``Normalize`` module: L2-normalized), and ``config.json``'s Matryoshka fields. Without
any of those an embedding model pools the last token and normalizes (vLLM's default for
decoders); a sequence classifier always reads its score head at the last token and returns the
raw logits. The resolved config travels to the front end as JSON (``EngineConfig.pooler_config``
in the engine's summary), with ``kind`` (``embed`` or ``score``) set; a valid ``--pooler-config`` too. Pure values and file
reads: no torch, nothing about scheduling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
_USER_KEYS = ("pooling_type", "normalize", "is_matryoshka", "matryoshka_dimensions", "kind")
KINDS = ("embed", "score")
# vLLM's PoolerConfig keys that inflight does not implement (a refusal names them).
_VLLM_ONLY_KEYS = ("dimensions", "enable_chunked_processing", "max_embed_len", "softmax", "activation",
                   "use_activation", "logit_bias", "step_tag_id", "returned_token_ids")
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A served pooling model's pooling, resolved (see module docstring)."""

    kind: str  # "embed" (a vector per input) or "score" (a classifier's num_labels logits)
    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool  # L2-normalize the vector (after a Matryoshka truncation)
    is_matryoshka: bool = False  # the front end may truncate to ``dimensions``
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it may truncate to; None: any

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "pooling_type": self.pooling_type, "normalize": self.normalize,
                           "is_matryoshka": self.is_matryoshka,
                           "matryoshka_dimensions": list(self.matryoshka_dimensions)
                           if self.matryoshka_dimensions is not None else None})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> PoolerConfig:
        """The resolved config a pooling engine's summary carries."""
        raw = json.loads(text)
        dims = raw.get("matryoshka_dimensions")
        return cls(raw["kind"], raw["pooling_type"], bool(raw["normalize"]), bool(raw.get("is_matryoshka")),
                   tuple(dims) if dims is not None else None)  # fmt: skip


def parse_pooler_config(text: str) -> dict[str, Any]:
    """``--pooler-config`` (a JSON object) checked key by key; ``ValueError`` naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pooler_config must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("pooler_config must be a JSON object, e.g. {\"pooling_type\": \"MEAN\", \"normalize\": true}.")
    unsupported = sorted(k for k in raw if k in _VLLM_ONLY_KEYS)
    if unsupported:
        raise ValueError(f"pooler_config key(s) {', '.join(unsupported)} are not supported here; supported: "
                         f"{', '.join(_USER_KEYS)}.")
    unknown = sorted(k for k in raw if k not in _USER_KEYS)
    if unknown:
        raise ValueError(f"unknown pooler_config key(s) {', '.join(unknown)}; supported: {', '.join(_USER_KEYS)}.")
    kind = raw.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in POOLING_TYPES):
        raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)} (got {kind!r}).")
    if raw.get("kind", "embed") not in KINDS:
        raise ValueError(f"pooler_config kind must be one of {', '.join(KINDS)} (got {raw['kind']!r}).")
    for name in ("normalize", "is_matryoshka"):
        if name in raw and not isinstance(raw[name], bool):
            raise ValueError(f"pooler_config {name} must be true or false (got {raw[name]!r}).")
    dims = raw.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not dims
                             or not all(type(d) is int and d > 0 for d in dims)):
        raise ValueError("pooler_config matryoshka_dimensions must be a list of positive integers.")
    return {**raw, **({"pooling_type": kind.upper()} if kind is not None else {})}


def resolve_runner(runner: str, head: str) -> str:
    """``generate`` or ``pooling`` for ``runner`` (an ``EngineConfig.runner`` value) and the
    checkpoint's head (``ModelSpec.head``); ``ValueError`` when they cannot go together."""
    if runner == "auto":
        return "generate" if head == "lm" else "pooling"
    if runner == "generate" and head != "lm":
        raise ValueError("this checkpoint has no LM head (an embedding model or a sequence classifier); "
                         "serve it with --runner pooling (or auto).")
    return runner


def resolve_pooler(model_dir: str | Path, hf_config: Any, head: str, override: str | None,
                   default_type: str = "LAST") -> PoolerConfig:
    """The pooling of the checkpoint at ``model_dir`` (``head``: ``ModelSpec.head``), with
    ``override`` (``--pooler-config``) on top of what the directory says. ``default_type``: the
    pooling without either, and where a classifier reads its head (LAST for a decoder, CLS for a
    BERT encoder)."""
    user = parse_pooler_config(override) if override is not None else {}
    dims = user.get("matryoshka_dimensions", getattr(hf_config, "matryoshka_dimensions", None))
    matryoshka = bool(user.get("is_matryoshka", getattr(hf_config, "is_matryoshka", False))) or dims is not None
    dims_t = tuple(int(d) for d in dims) if dims is not None else None
    if user.get("kind", "score" if head == "score" else "embed") != ("score" if head == "score" else "embed"):
        raise ValueError(f"pooler_config kind {user['kind']!r} does not fit this checkpoint "
                         f"({'a sequence classifier' if head == 'score' else 'an embedding model'}).")
    if head == "score":
        if user.get("pooling_type", default_type) != default_type:
            raise ValueError(f"a sequence classifier reads its score head where it was trained to: pooling_type "
                             f"{default_type} only.")
        if user.get("normalize"):
            raise ValueError("a sequence classifier returns its raw logits: normalize cannot be true.")
        return PoolerConfig("score", default_type, False)
    st_type, st_normalize = _sentence_transformers_pooling(Path(model_dir), strict="pooling_type" not in user)
    return PoolerConfig("embed", user.get("pooling_type", st_type or default_type),
                        user.get("normalize", st_normalize if st_type is not None else True), matryoshka, dims_t)


def _sentence_transformers_pooling(model_dir: Path, strict: bool) -> tuple[str | None, bool]:
    """(the pooling type, whether a Normalize module follows) from sentence-transformers'
    ``modules.json``; (None, False) without one. A pooling mode inflight lacks is a ``ValueError``
    when ``strict`` (no ``pooling_type`` given instead), else read as LAST (then replaced)."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None, False
    modules = json.loads(path.read_text())
    pooling_type, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("models.Normalize"):
            normalize = True
        elif kind.endswith("models.Pooling"):
            config = model_dir / str(module.get("path", "")) / "config.json"
            modes = json.loads(config.read_text()) if config.is_file() else {}
            on = [name for name, value in modes.items() if name.startswith("pooling_mode_") and value is True]
            known = [_ST_POOLING_MODES[m] for m in on if m in _ST_POOLING_MODES]
            if (len(on) != 1 or len(known) != 1) and strict:
                raise ValueError(f"{config}: pooling modes {on or 'none'}; inflight pools with exactly one of "
                                 f"{', '.join(_ST_POOLING_MODES)}.")
            pooling_type = known[0] if len(known) == 1 else "LAST"
    return pooling_type, normalize
