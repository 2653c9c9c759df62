"""Whether the endpoint picker the operator renders can route, and what that means for ``Ready``.

Owns the ``PickerReady`` condition, read from the picker Deployment (``<name>-epp``): ready when at
least one replica is (with leader election only the leader is, the others stand by), else not,
with the pool's failure mode in the message. With ``failureMode: FailClose`` a Gateway fails every
request to the pool while no picker answers, so the model is not ``Ready`` then, whatever its
runtime pods say (``ready_override``); with ``FailOpen`` it routes without the picker (no load-aware
placement) and ``Ready`` stands. A picker the user runs (``create: false``) is not looked at. Pure;
knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator.render_pool import picker_name
from inflight.operator.spec import InferenceSpec
from inflight.operator.status import Condition

CONDITION = "PickerReady"


def watched(spec: InferenceSpec) -> bool:
    """Whether the operator renders the picker (and so reports on it)."""
    return spec.inference_pool.enabled and spec.inference_pool.create_picker


def condition(spec: InferenceSpec, picker: dict[str, Any] | None) -> Condition:
    """``PickerReady`` from the picker Deployment as it is (None: missing)."""
    name = picker_name(spec.name)
    mode = spec.inference_pool.failure_mode
    effect = ("the Gateway fails every request to this pool (failureMode FailClose)" if mode == "FailClose"
              else "the Gateway routes without it, with no load-aware placement (failureMode FailOpen)")
    if picker is None:
        return Condition(CONDITION, False, "PickerMissing",
                         f"the endpoint picker Deployment {name} does not exist (the operator re-creates it); {effect}")
    want = int((picker.get("spec") or {}).get("replicas") or 0)
    ready = int((picker.get("status") or {}).get("readyReplicas") or 0)
    if ready >= 1:
        standby = f"; {want - 1} standing by (leader election)" if want > 1 else ""
        return Condition(CONDITION, True, "PickerAvailable", f"the endpoint picker {name} answers{standby}")
    return Condition(CONDITION, False, "PickerUnavailable",
                     f"no replica of the endpoint picker {name} is ready (0/{want}): {effect}")


def ready_override(spec: InferenceSpec, picker: Condition) -> Condition | None:
    """``Ready=False`` while a FailClose pool has no picker (the runtime pods' readiness aside)."""
    if picker.status or spec.inference_pool.failure_mode != "FailClose":
        return None
    return Condition("Ready", False, picker.reason, f"requests through the InferencePool fail: {picker.message}")
