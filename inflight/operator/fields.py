"""Small validators for CR values: each returns the typed value or raises ``ValueError`` naming
the field (``prefix.key``) and what would be accepted.

Owns the primitive checks (string, int, number, object, list, name patterns, quantities,
int-or-percent) shared by the spec parsers, and :func:`default` (a spec dataclass's field
default: the one copy the parsers and the CRD builder read). Knows nothing about what the
fields mean.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")  # a key in a Secret's data
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# Extended resource names: "<domain>/<name>", e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu.
RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
PERCENT = re.compile(r"^[0-9]{1,3}%$")


def default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (``KeyError`` when it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def obj(raw: dict[str, Any], key: str, prefix: str, required: bool = False) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        if required:
            raise ValueError(f"{prefix}.{key} is required.")
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{prefix}.{key} must be an object (got {type(value).__name__}).")
    return value


def list_of_obj(raw: dict[str, Any], key: str, prefix: str) -> list[dict[str, Any]]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{prefix}.{key} must be a list of objects.")
    return value


def string(raw: dict[str, Any], key: str, default: str | None, prefix: str) -> str:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{prefix}.{key} is required.")
    if not isinstance(value, str):
        raise ValueError(f"{prefix}.{key} must be a string (got {value!r}).")
    return value


def optional_string(raw: dict[str, Any], key: str, prefix: str) -> str | None:
    return None if raw.get(key) is None else string(raw, key, None, prefix)


def integer(raw: dict[str, Any], key: str, default: int, minimum: int, prefix: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{prefix}.{key} must be an integer >= {minimum} (got {value!r}).")
    return value


def number(raw: dict[str, Any], key: str, default: float, prefix: str, zero: bool = False) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{prefix}.{key} must be a number {bound} (got {value!r}).")
    return float(value)


def optional_number(raw: dict[str, Any], key: str, prefix: str) -> float | None:
    """A finite number > 0, or None when the field is unset (or null)."""
    if raw.get(key) is None:
        return None
    value = number(raw, key, 0.0, prefix)
    if not math.isfinite(value):
        raise ValueError(f"{prefix}.{key} must be a finite number > 0 (got {raw.get(key)!r}).")
    return value


def matching(value: str, pattern: re.Pattern[str], what: str, example: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"{what} {value!r} is not valid (e.g. {example}).")
    return value


def quantity(raw: dict[str, Any], key: str, prefix: str) -> str | None:
    """A resource quantity such as ``8Gi`` or ``4``; ``None`` when unset."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{prefix}.{key} must be a quantity such as 8Gi (got {value!r}).")
    return matching(str(value), QUANTITY, f"{prefix}.{key}", "8Gi, 500m, 4")


def int_or_percent(raw: dict[str, Any], key: str, default: int | str, prefix: str) -> int | str:
    value = raw.get(key, default)
    if isinstance(value, bool) or not (
        (isinstance(value, int) and value >= 0) or (isinstance(value, str) and PERCENT.match(value))
    ):
        raise ValueError(f"{prefix}.{key} must be an integer >= 0 or a percentage like '25%' (got {value!r}).")
    return value


def string_map(raw: dict[str, Any], key: str, prefix: str) -> dict[str, str]:
    value = obj(raw, key, prefix)
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{prefix}.{key} values must be strings (not for {', '.join(map(str, bad))}).")
    return {str(k): v for k, v in value.items()}


def positive_or_zero(value: int | str) -> bool:
    """Whether an int-or-percent value is above zero."""
    return bool(value) if isinstance(value, int) else value.rstrip("%").lstrip("0") != ""
