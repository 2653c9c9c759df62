"""Default sampling for requests that leave fields out: vLLM's ``--generation-config``.

Owns reading the sampling fields of a ``generation_config.json`` (``auto``: the served model
directory's; a directory: that directory's; ``vllm``: none) and putting
``--override-generation-config`` on top, into one frozen :class:`SamplingDefaults` that the
request parser fills omitted fields from. The fields are vLLM's: temperature, top_p, top_k,
min_p, repetition_penalty. ``max_new_tokens``, which vLLM turns into a cap on every request's
``max_tokens``, is not applied; it and any other key of the override are named in the start-up
log (:meth:`SamplingDefaults.describe`) instead of being dropped silently. Knows nothing about
HTTP or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.sampling_params import SamplingParams

AUTO, VLLM = "auto", "vllm"
FILE_NAME = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CAPS = ("max_new_tokens",)  # in vLLM's list, as a cap on max_tokens; reported, not applied here


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request gets for each sampling field it leaves out (``None``: OpenAI's default).
    ``source``: where the values came from; ``ignored``: keys that were given and not applied."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = ""
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        SamplingParams(**self.values())  # each value within SamplingParams' bounds (ValueError naming it)

    def values(self) -> dict[str, Any]:
        """The fields that are set."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def describe(self) -> str:
        """One line for the start-up log."""
        values = self.values()
        if values:
            text = ", ".join(f"{k}={v}" for k, v in values.items()) + f" (from {self.source})"
        else:
            text = f"OpenAI's for every field ({self.source or 'no generation config'} sets none)"
        if self.ignored:
            text += f"; not applied: {', '.join(self.ignored)}"
        return text


def from_mapping(config: dict[str, Any], source: str, extra_ignored: tuple[str, ...] = ()) -> SamplingDefaults:
    """The sampling fields of ``config`` (``None`` values skipped, as vLLM does); raises
    ``ValueError`` naming ``source`` and the field when a value is out of bounds."""
    values = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    values = {k: float(v) if type(v) is int and k != "top_k" else v for k, v in values.items()}
    ignored = tuple(name for name in CAPS if config.get(name) is not None) + extra_ignored
    try:
        return SamplingDefaults(**values, source=source, ignored=ignored)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {str(exc).rstrip('.')}") from None


def source_problem(value: str) -> str | None:
    """Why ``--generation-config value`` cannot be used (one line), or ``None``."""
    if value in (AUTO, VLLM):
        return None
    path = Path(value)
    if not path.is_dir():
        return f"--generation-config {value}: not auto, vllm or a directory"
    if not (path / FILE_NAME).is_file():
        return f"--generation-config {value}: the directory has no {FILE_NAME}"
    return None


def parse_override(text: str) -> dict[str, Any]:
    """``--override-generation-config``'s JSON object (``ValueError`` for anything else or a
    sampling field out of bounds)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}); e.g. '{{\"temperature\": 0.5}}'") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    from_mapping(value, "--override-generation-config")
    return value


def load_sampling_defaults(mode: str, model_dir: Path, override: dict[str, Any] | None = None) -> SamplingDefaults:
    """The defaults ``--generation-config mode`` and ``--override-generation-config`` give for
    ``model_dir`` (the override applies with ``vllm`` too, as in vLLM)."""
    config: dict[str, Any] = {}
    sources: list[str] = []
    if mode != VLLM:
        path = (model_dir if mode == AUTO else Path(mode)) / FILE_NAME
        if path.is_file():
            config = _read(path)
            sources.append(str(path.resolve()))  # through a serving overlay's link to the model's own
        elif mode != AUTO:
            raise ValueError(source_problem(mode) or f"--generation-config {mode}: no {FILE_NAME}")
    override = override or {}
    known = (*SAMPLING_FIELDS, *CAPS)
    extra = tuple(f"{key} (--override-generation-config)" for key in override if key not in known)
    if override:
        sources.append("--override-generation-config")
    config.update(override)
    if not sources:
        sources.append("--generation-config vllm" if mode == VLLM else f"{model_dir}, which has no {FILE_NAME},")
    try:
        return from_mapping(config, " + ".join(sources), extra)
    except ValueError as exc:
        raise ValueError(f"{exc}; set the field with --override-generation-config, or serve with "
                         "--generation-config vllm to ignore the file") from None


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}); fix it or serve with --generation-config vllm") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object; fix it or serve with --generation-config vllm")
    return value
