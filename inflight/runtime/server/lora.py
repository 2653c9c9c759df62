"""The front end's side of LoRA adapters (issue 49), in vLLM's terms: ``--lora-modules``, a request's
``model`` naming an adapter, and the adapters' /v1/models cards.

Owns :class:`LoRAModule` (one ``--lora-modules`` entry) and its two spellings
(:func:`parse_lora_module`: ``name=path``, or the JSON object ``{"name", "path", "base_model_name"}``),
:func:`resolve_model` (a request's ``model`` -> the adapter to run it with, None for the served
model, else OpenAI's 404 ``model_not_found``) and :func:`lora_cards` (one card per loaded adapter,
``parent`` the served model or the module's ``base_model_name``, ``root`` its path). Which adapters
are loaded is the engine client's (``EngineClient.loras``); loading them is the engine's. Knows
nothing about HTTP routing or processes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.runtime.lora.types import LoRAInfo
from inflight.runtime.server.errors import APIError

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: an adapter loaded at start (vLLM's ``LoRAModulePath``).
    ``base_model_name``: the ``parent`` /v1/models names for it (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        problem = lora_name_problem(self.name)
        if problem:
            raise ValueError(f"--lora-modules: {problem}")
        if not self.path:
            raise ValueError(f"--lora-modules {self.name}: the adapter's path is empty")


def lora_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an adapter (it goes into /v1/models and a metric label), or None."""
    if not isinstance(name, str) or not name:
        return "an adapter's name must be a non-empty string"
    if len(name) > MAX_LORA_NAME_CHARS or not name.isprintable() or "," in name or name != name.strip():
        return (f"adapter name {name[:80]!r}: at most {MAX_LORA_NAME_CHARS} printable characters, no comma "
                "(the metric joins names with commas) and no surrounding spaces")
    return None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` (vLLM's two forms);
    ``ValueError`` naming what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text[:80]!r} is not valid JSON: {exc}") from None
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
        if not isinstance(obj, dict) or unknown or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {text[:80]!r}: the JSON form is an object with \"name\" and "
                             "\"path\" (strings) and optionally \"base_model_name\"")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text[:80]!r}: \"base_model_name\" must be a string")
        return LoRAModule(obj.get("name"), obj["path"], base or None)
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules {text[:80]!r}: give name=path or a JSON object")
    return LoRAModule(name, path)


def check_unique(modules: Sequence[LoRAModule], served: str) -> None:
    """``ValueError`` for two modules of one name, or one named as the served model."""
    seen: set[str] = set()
    for module in modules:
        if module.name == served:
            raise ValueError(f"--lora-modules {module.name}: the served model has that name (--served-model-name)")
        if module.name in seen:
            raise ValueError(f"--lora-modules names {module.name!r} twice")
        seen.add(module.name)


def resolve_model(model: str | None, served: str, loras: Mapping[str, LoRAInfo]) -> str | None:
    """The adapter a request's ``model`` selects: None for the served model (or no ``model``),
    the adapter's name when one of that name is loaded, else 404 ``model_not_found``."""
    if model is None or model == served:
        return None
    if model in loras:
        return model
    adapters = f" and the LoRA adapters {', '.join(sorted(loras)[:20])}" if loras else ""
    raise APIError(404, f"model '{model}' is not served here; this server serves '{served}'{adapters} "
                        "(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")


def answered_model(model: object, served: str, loras: Mapping[str, LoRAInfo]) -> str:
    """The ``model`` a response names: the adapter the request named, else the served model
    (whether the request's ``model`` is served at all is :func:`resolve_model`'s to say)."""
    return model if isinstance(model, str) and model in loras else served


def lora_cards(loras: Mapping[str, LoRAInfo], served: str, parents: Mapping[str, str | None],
               created: int, max_model_len: int | None) -> list[dict[str, Any]]:
    """One /v1/models card per adapter: ``root`` its path, ``parent`` ``parents[name]`` (a
    ``--lora-modules`` base_model_name) or the served model."""
    cards = []
    for name, info in loras.items():
        card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "inflight",
                                "root": info.path, "parent": parents.get(name) or served}
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        cards.append(card)
    return cards
