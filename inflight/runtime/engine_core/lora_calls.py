"""The engine core's side of LoRA (issue 49): the LoRA calls, answered between two steps, and the
adapter names of running and waiting requests, put into the stats the core sends.

:func:`answer` runs one :data:`~.protocol.LoRACall` on the engine (``add_lora``, ``remove_lora``,
``list_loras``) and returns its :class:`~.protocol.LoRADone`. A refused adapter (``LoRAError``), an
unknown name (``UnknownLoRA``) or any other failure of the call is an answer, never an exception in
the loop: requests in flight never see it (the adapters of running and waiting requests are in
the engine's own stats: :func:`inflight.runtime.core.engine_stats.with_lora_stats`). Knows nothing
about connections or front ends.
"""

from __future__ import annotations

import logging
from typing import Any

from inflight.runtime.engine_core import protocol as p
from inflight.runtime.lora.types import LoRAError, LoRAInfo, UnknownLoRA

logger = logging.getLogger("inflight.engine_core")


def answer(engine: Any, call: p.LoRACall) -> p.LoRADone:
    """Run ``call`` on ``engine`` (between two steps) and say how it went."""
    info: LoRAInfo | None = None
    try:
        if isinstance(call, p.LoadLoRA):
            info = engine.add_lora(call.name, call.path)
            logger.info("LoRA adapter %r loaded from %s (rank %d)", info.name, info.path, info.rank)
        elif isinstance(call, p.UnloadLoRA):
            engine.remove_lora(call.name)
            logger.info("LoRA adapter %r unloaded", call.name)
    except LoRAError as exc:
        return p.LoRADone(call.call_id, loaded(engine), error=str(exc), error_kind="refused")
    except UnknownLoRA as exc:
        return p.LoRADone(call.call_id, loaded(engine), error=unknown_message(exc), error_kind="unknown")
    except Exception as exc:  # noqa: BLE001 - a failed load must not fail the loop or the requests in flight
        logger.exception("LoRA call %s failed", type(call).__name__)
        return p.LoRADone(call.call_id, loaded(engine), error=f"{type(exc).__name__}: {exc}", error_kind="failed")
    return p.LoRADone(call.call_id, loaded(engine), info)


def loaded(engine: Any) -> tuple[LoRAInfo, ...]:
    """Every adapter ``engine`` has loaded (none when LoRA is off)."""
    return tuple(engine.list_loras()) if engine.config.enable_lora else ()


def unknown_message(exc: BaseException) -> str:
    """A ``LookupError``'s text without ``KeyError``'s quotes."""
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)
