"""The kinds of answer inflight gives to a ``vllm serve`` flag, and the row type.

Owns ``VllmFlag`` and its constructors (``alias``, ``notice``, ``switch``, ``refused``,
``refused_on``, ``only``) and the values vLLM spells differently (``VALUE_ALIASES``). ``alias``:
the same behaviour under an inflight flag; ``notice``: accepted, changes nothing here, one line
in the log says why; ``refused``: exit 2 naming why; ``only``: some values are accepted (with a
notice), the others refused. The rows themselves are ``vllm_flag_rows`` and ``vllm_flag_rows_engine``.
Knows nothing about argparse.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIAS, NOTICE, REFUSED, ONLY = "alias", "notice", "refused", "only"
# Values vLLM spells differently, accepted by inflight's own flags too (by argparse dest).
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},
    "log_level": {"trace": "debug"},
    # vLLM's --task values (an alias of --runner): the pooling tasks are the pooling runner's
    "runner": {"embed": "pooling", "embedding": "pooling", "classify": "pooling", "score": "pooling"},
}


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """One vLLM flag. ``text``: for ``alias`` the inflight flag, otherwise why (the notice, or
    the refusal). ``nargs``: the values vLLM's flag takes (0: a switch, 1, "?" or "+").
    ``negatable``: vLLM also has ``--no-<name>``; for a refused switch that form asks for what
    inflight does anyway and is accepted with a notice. ``values`` (``only``): the accepted
    values. ``note``: for ``alias`` what differs, for ``only`` the notice of an accepted value."""

    names: tuple[str, ...]
    kind: str
    text: str
    nargs: int | str = 1
    negatable: bool = False
    values: tuple[str, ...] = ()
    note: str = ""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def negative(self) -> str | None:
        return "--no-" + self.name[2:] if self.negatable else None


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else names


def alias(names: str | tuple[str, ...], target: str, note: str = "", nargs: int | str = 1,
          negatable: bool = False) -> VllmFlag:
    return VllmFlag(_names(names), ALIAS, target, nargs, negatable, note=note)


def notice(names: str | tuple[str, ...], why: str, nargs: int | str = 1, negatable: bool = False) -> VllmFlag:
    return VllmFlag(_names(names), NOTICE, why, nargs, negatable)


def switch(names: str | tuple[str, ...], why: str, negatable: bool = True) -> VllmFlag:
    """A vLLM on/off flag that changes nothing here either way."""
    return notice(names, why, 0, negatable)


def refused(names: str | tuple[str, ...], why: str, nargs: int | str = 1, negatable: bool = False) -> VllmFlag:
    return VllmFlag(_names(names), REFUSED, why, nargs, negatable)


def refused_on(names: str | tuple[str, ...], why: str, negatable: bool = True) -> VllmFlag:
    """A vLLM switch that turns on what inflight lacks (its ``--no-`` form is accepted)."""
    return refused(names, why, 0, negatable)


def only(names: str | tuple[str, ...], values: tuple[str, ...], note: str, why: str) -> VllmFlag:
    return VllmFlag(_names(names), ONLY, why, 1, values=values, note=note)
