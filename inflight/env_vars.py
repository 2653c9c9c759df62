"""Every ``INFLIGHT_*`` environment variable: one typed registry, small accessors, the doc table.

Settings belong in ``EngineConfig`` (flags, CRD fields); what remains here is what has no
flag: process-level knobs (threads, caches, tensor-parallel timeouts), the operator's own
settings (the chart sets them), secrets kept off the command line, and test hooks (marked
``test_only``). Code reads a variable through :func:`read_str`, :func:`read_int`,
:func:`read_float` or :func:`read_bool`, which refuse an unregistered name, so a new
variable cannot appear without a row here; ``tests/test_env_vars.py`` checks that every
``INFLIGHT_*`` name in the tree is registered and that ``docs/environment.md`` is current
(``python -m inflight.env_vars`` rewrites its table). Imports nothing but the standard
library; knows nothing about what its readers do with a value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from inflight.generated_docs import replace_section

DOC_BEGIN, DOC_END = "<!-- env-vars:begin -->", "<!-- env-vars:end -->"


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its type, its default (None: unset means "not given"), who reads it."""

    name: str
    type: type
    default: object
    readers: tuple[str, ...]  # the modules that read it
    meaning: str  # one line
    test_only: bool = False


_R, _S, _TP, _OP = "inflight.runtime", "inflight.runtime.server", "inflight.runtime.distributed", "inflight.operator"
VARIABLES: tuple[EnvVar, ...] = (
    # -- the runtime process ----------------------------------------------------------------
    EnvVar("INFLIGHT_API_KEY", str, None, (f"{_R}.cli.server_flags",),
           "the key /v1 requires when --api-key is not given (the operator sets it from a Secret)"),
    EnvVar("INFLIGHT_ADMIN_API_KEY", str, None, (f"{_R}.cli.server_flags",),
           "enables /admin with this key when --admin-api-key is not given (the operator sets it)"),
    EnvVar("INFLIGHT_METRICS_API_KEY", str, None, (f"{_R}.cli.server_flags",),
           "the key /metrics requires (besides the admin key) when --metrics-api-key is not given"),
    EnvVar("INFLIGHT_SINGLE_PROCESS", bool, False, (f"{_R}.cli.server_flags",),
           "run the engine in the server's process (debugging); the --single-process default"),
    EnvVar("INFLIGHT_MAKE_RUN", bool, False, (f"{_R}.cli.preflight",),
           "set by `make run`: start-up errors name its variables (PORT=) instead of the flags"),
    EnvVar("INFLIGHT_STATS_LOG_INTERVAL_S", float, 10.0, (f"{_R}.core.stats_log",),
           "seconds between the engine's stats log lines (values <= 0 or not numbers: the default)"),
    EnvVar("INFLIGHT_KERNEL_BACKEND", str, None, ("inflight.kernels.dispatch",),
           "overrides EngineConfig.kernel_backend (same choices as --kernel-backend) for experiments; "
           "logs a warning when it differs from the configured value"),
    EnvVar("INFLIGHT_CPU_THREADS", int, None, (f"{_R}.worker.cpu.device_setup",),
           "intra-op threads of every CPU step (else OMP_NUM_THREADS, else cores - 1 / all cores)"),
    EnvVar("INFLIGHT_CPU_LANES", int, None, (f"{_R}.worker.cpu.device_setup",),
           "decode lanes on the CPU (0 or 1: off; unset: none where MKL's packed weights are split in column blocks, else one per thread a big step may use)"),
    EnvVar("INFLIGHT_KV_GROUPS", int, 1, (f"{_R}.worker.kv_layout",),
           "0: one KV block table for every layer of a model that mixes full and sliding-window attention "
           "(else one per group of layers, windowed groups freeing what leaves their window: docs/kv-groups.md)"),
    EnvVar("INFLIGHT_CPU_PREPACK", int, 1, ("inflight.kernels.cpu_prepack",),
           "0: keep float32 linear weights unpacked on the CPU (else they are packed once at load for MKL's or oneDNN's GEMM)"),
    EnvVar("INFLIGHT_CPU_PACK_FORMAT", str, None, ("inflight.kernels.cpu_prepack",),
           "mkl or onednn: the layout float32 CPU linear weights are packed in (unset: MKL's on Intel CPUs, "
           "oneDNN's on others, where it is the faster GEMM); onednn-bf16: oneDNN's, with every linear's product "
           "in bfloat16 (AMX where the CPU has it) and the rest of the model float32"),
    EnvVar("INFLIGHT_CPU_FLOAT_COPY", int, None, ("inflight.kernels.cpu_prepack",),
           "1: packed CPU linear weights also keep their float32 weights for products of few rows (2x their "
           "memory); 0: never; unset: on every CPU but Intel's, where MKL's packed GEMM is slow at few rows"),
    EnvVar("INFLIGHT_CPU_MALLOC_TUNING", int, 1, (f"{_R}.worker.cpu.allocator",),
           "0: leave glibc's malloc as it is (else a CPU engine keeps the memory a step frees for the next step "
           "instead of returning it to the kernel and faulting it in again)"),
    EnvVar("INFLIGHT_CPU_HUGE_PAGES", int, 1, ("inflight.kernels.cpu_huge_pages",),
           "0: leave the CPU KV cache on the kernel's default pages (else it asks for transparent huge pages, "
           "madvise, so a decode step's scattered block reads miss the TLB less)"),
    EnvVar("INFLIGHT_CACHE_DIR", str, None, ("inflight.cache",),
           "where built kernels and converted models are kept (else $XDG_CACHE_HOME/inflight)"),
    EnvVar("INFLIGHT_TP_START_TIMEOUT_S", float, 1800.0, (f"{_TP}.launcher", f"{_TP}.headless"),
           "seconds tensor-parallel start-up (every rank loading its shard) may take; read at import"),
    EnvVar("INFLIGHT_TP_COLLECTIVE_TIMEOUT_S", float, 60.0, (f"{_TP}.launcher",),
           "seconds one collective inside a tensor-parallel step may take; read at import"),
    EnvVar("INFLIGHT_TP_INLINE_INTS", int, 8192, (f"{_TP}.comm",),
           "int64s of a step message carried inline (larger steps take a second broadcast); read at import"),
    EnvVar("INFLIGHT_TEST_ENGINE_FAULT", str, None, (f"{_R}.engine_faults",),
           "die-after-steps:N, stall-after-steps:N or slow-steps:MS: an injected engine-thread death, "
           "stall, or MS milliseconds of sleep before every step", test_only=True),
    EnvVar("INFLIGHT_TEST_GRAMMAR_FAULT", str, None, (f"{_R}.structured.faults",),
           "slow-compile:MARKER or slow-mask:MARKER: the compile or the token masks of a constraint "
           "containing MARKER stall until released", test_only=True),
    # -- the operator (the chart sets these) --------------------------------------------------
    EnvVar("INFLIGHT_OPERATOR_TICK_SECONDS", float, 5.0, (f"{_OP}.context",),
           "how often the timer runs per resource (status, live config, autoscaling)"),
    EnvVar("INFLIGHT_OPERATOR_POD_TIMEOUT_SECONDS", float, 3.0, (f"{_OP}.context",),
           "timeout of one metrics scrape or admin call to a pod"),
    EnvVar("INFLIGHT_OPERATOR_LEASE_NAME", str, "", (f"{_OP}.context",),
           "the leader-election Lease's name (empty: no leader election)"),
    EnvVar("INFLIGHT_OPERATOR_LEASE_SECONDS", float, 15.0, (f"{_OP}.context",),
           "a leader that has not renewed the Lease for this long is replaced"),
    EnvVar("INFLIGHT_OPERATOR_API_TIMEOUT_SECONDS", float, 30.0, (f"{_OP}.context",),
           "per Kubernetes API request; past it the request counts as refused (ApplyFailed, Timeout)"),
    EnvVar("INFLIGHT_OPERATOR_RETRY_BASE_SECONDS", float, 5.0, (f"{_OP}.context",),
           "the first retry of an apply refused for a reason other than the spec; doubled each retry"),
    EnvVar("INFLIGHT_OPERATOR_RETRY_MAX_SECONDS", float, 300.0, (f"{_OP}.context",),
           "the longest wait between retries of a refused apply"),
    EnvVar("INFLIGHT_OPERATOR_FULL_CHECK_EVERY_TICKS", int, 6, (f"{_OP}.context",),
           "every Nth tick reads every child and the namespace's HPAs; the others read the Deployment only"),
    EnvVar("INFLIGHT_OPERATOR_ACTIVATOR_URL", str, "", (f"{_OP}.context",),
           "the chart's activator (minReplicas: 0 holds requests there); empty: none, never scale to 0"),
    EnvVar("INFLIGHT_OPERATOR_ACTIVATOR_PODS", str, "", (f"{_OP}.context",),
           "label selector (k=v,...) of the activator's pods in the operator's namespace: each replica is "
           "asked for its demand and the answers summed; empty: ask INFLIGHT_OPERATOR_ACTIVATOR_URL only"),
    EnvVar("INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS", str, "1", (f"{_OP}.context",),
           "pod-template changes the operator causes (its version, the runtime image default, a new root key) "
           "roll this many models at a time; manual: each waits for inflight.dev/rollout=approved; unlimited"),
    EnvVar("INFLIGHT_OPERATOR_LIVENESS_PORT", int, 0, (f"{_OP}.context",),
           "kopf's liveness port, answered while standing by (0: off)"),
    EnvVar("INFLIGHT_OPERATOR_ROOT_SECRET", str, "inflight-operator-root-key", (f"{_OP}.context",),
           "the Secret holding the root of the admin keys, in the operator's namespace"),
    EnvVar("INFLIGHT_OPERATOR_METRICS_PORT", int, 0, (f"{_OP}.operator_metrics",),
           "the operator's /metrics port (0 or empty: off)"),
    EnvVar("INFLIGHT_OPERATOR_RUNTIME_IMAGE", str, None, (f"{_OP}.spec",),
           "the runtime image of an InferenceDeployment without spec.image (the chart's runtimeImage; "
           "unset: the image of this release)"),
    EnvVar("INFLIGHT_OPERATOR_PICKER_IMAGE", str, None, (f"{_OP}.spec",),
           "the endpoint picker image when spec.inferencePool.endpointPicker.image is unset (the chart's "
           "pickerImage; unset: the built-in one)"),
    EnvVar("INFLIGHT_OPERATOR_PICKER_CLUSTER_ROLE", str, None, (f"{_OP}.spec",),
           "the ClusterRole with the endpoint picker's rights (the chart's <release>-epp): each rendered picker "
           "gets a ServiceAccount and a RoleBinding to it (unset: no picker RBAC rendered)"),
    EnvVar("INFLIGHT_OPERATOR_PICKER_METRICS_AUTH", str, "true", (f"{_OP}.spec",),
           "true: the endpoint picker's /metrics asks for a token (TokenReview + SubjectAccessReview, the "
           "picker's default); false: rendered with --metrics-endpoint-auth=false (the chart's pickerMetrics.auth)"),
    EnvVar("INFLIGHT_LIVE_<FIELD>", str, None, (f"{_OP}.engine_args", f"{_OP}.pod_settings"),
           "set by the operator in runtime pods: a live engine field (e.g. INFLIGHT_LIVE_MAX_NUM_SEQUENCES) "
           "the pod template's args refer to; reserved, never set by a user"),
    # -- installing and testing -----------------------------------------------------------------
    EnvVar("INFLIGHT_TORCH", str, "auto", ("scripts.install_torch", "Makefile"),
           "which torch build `make install` installs: auto, cpu or cuda"),
    EnvVar("INFLIGHT_TORCH_CPU_INDEX", str, "https://download.pytorch.org/whl/cpu", ("scripts.install_torch",),
           "the wheel index of the CPU build"),
    EnvVar("INFLIGHT_MODELS_DIR", str, None, ("tests.realmodel.conftest",),
           "where the real-model tests look for the fetched model package", test_only=True),
    EnvVar("INFLIGHT_TP_REPORT", bool, False, ("tests.runtime.test_tensor_parallel",),
           "print the measured worst-case TP=N vs TP=1 difference", test_only=True),
)
REGISTRY: dict[str, EnvVar] = {v.name: v for v in VARIABLES}
# Families of names: INFLIGHT_LIVE_MAX_NUM_SEQUENCES is an INFLIGHT_LIVE_<FIELD>.
PREFIXES: dict[str, EnvVar] = {v.name.partition("<")[0]: v for v in VARIABLES if v.name.endswith(">")}


def lookup(name: str) -> EnvVar:
    """The registry's row for ``name`` (a family's row for a member); ``KeyError`` if none."""
    if name in REGISTRY:
        return REGISTRY[name]
    for prefix, var in PREFIXES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return var
    raise KeyError(f"{name} is not a registered environment variable (add it to inflight/env_vars.py)")


def read_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The raw value of ``name``, else its default as a string (None when it has none)."""
    var = lookup(name)
    raw = (os.environ if environ is None else environ).get(name)
    if raw is not None:
        return raw
    return None if var.default is None else str(var.default)


def _parse(name: str, kind: type, what: str, environ: Mapping[str, str] | None) -> object:
    var = lookup(name)
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return var.default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what} (got {raw!r}).") from None


def read_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """``name`` as an int; its default when unset or empty; ``ValueError`` when not an int."""
    return _parse(name, int, "an integer", environ)  # type: ignore[return-value]


def read_float(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """``name`` as a float; its default when unset or empty; ``ValueError`` when not a number."""
    return _parse(name, float, "a number", environ)  # type: ignore[return-value]


def read_bool(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``name`` is set to anything but ``""`` or ``"0"``."""
    lookup(name)
    return (os.environ if environ is None else environ).get(name, "") not in ("", "0")


def markdown_table() -> str:
    """The generated part of docs/environment.md."""
    lines = ["Generated from `inflight/env_vars.py` (`python -m inflight.env_vars` rewrites it); a test "
             "checks that every `INFLIGHT_*` name in the tree is here.", "",
             "| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for var in VARIABLES:
        default = "unset" if var.default is None else f"`{var.default!r}`" if var.type is str else f"`{var.default}`"
        meaning = ("**test only**: " if var.test_only else "") + var.meaning.replace("|", "\\|")
        readers = ", ".join(f"`{r}`" for r in var.readers)
        lines.append(f"| `{var.name}` | {var.type.__name__} | {default} | {readers} | {meaning} |")
    return "\n".join(lines)


def with_table(doc: str) -> str:
    """``doc`` with the text between the markers replaced by :func:`markdown_table`."""
    return replace_section(doc, DOC_BEGIN, DOC_END, markdown_table())


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/environment.md")
    path.write_text(with_table(path.read_text()))
