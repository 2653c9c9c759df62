"""Operator-wide settings and the per-process context handed to handlers through kopf's memo.

Owns ``OperatorConfig`` (read from ``INFLIGHT_OPERATOR_*`` env vars, validated) and
``OperatorContext``, the one holder of the operator's clients: the Kubernetes client and the
HTTP session used to reach pods, and the watch-fed caches the timer reads children from
(``informer``). Per-resource state (autoscaler history, which pods already
got the live config) lives in kopf's per-object memo, not here. Knows no handler logic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import kopf

from inflight import env_vars
from inflight.operator import admin_keys, rollout_gate, scale_to_zero
from inflight.operator.informer import Informers
from inflight.operator.kube import KubeClient

LoginFn = Callable[[], "kopf.ConnectionInfo | None"]


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    tick_seconds: float = 5.0  # how often the timer runs per resource (status, live config, autoscaling)
    pod_timeout_seconds: float = 3.0  # per scrape / admin call
    finalizer: str = "inflight.dev/finalizer"
    # Leader election (two replicas): the Lease's name ("" = off), its namespace (the operator's
    # own, where the root key Secret lives too),
    # this replica's identity (its pod name), and kopf's liveness port to answer while standing by.
    lease_name: str = ""
    lease_namespace: str = "default"
    identity: str = ""
    liveness_port: int = 0
    lease_seconds: float = 15.0  # a holder that has not renewed for this long is replaced
    root_secret: str = "inflight-operator-root-key"  # in lease_namespace: the admin keys' root
    api_timeout_seconds: float = 30.0  # per Kubernetes API request; past it the request counts as refused
    # An apply the API server refuses for a reason other than the spec (403 webhook or quota, 409,
    # 5xx, timeout) is retried after base * 2**n seconds (n: retries so far), at most max.
    retry_base_seconds: float = 5.0
    retry_max_seconds: float = 300.0
    # Every Nth tick reads every child (ConfigMap, Service, PDB, pool objects, the admin Secret by a
    # create, the cache PVC) and the namespace's HPAs; the other ticks read the Deployment only.
    full_check_every_ticks: int = 6
    # The chart's activator (``minReplicas: 0``: inflight.operator.scale_to_zero); "" = none.
    activator_url: str = ""
    # Its replicas (``activator_fleet``): the pods in the operator's namespace (lease_namespace)
    # matching this label selector (k=v,...), each asked for its demand; "" = activator_url only.
    activator_pods: str = ""
    # Pod-template changes the operator itself causes (its version, the runtime image default, a
    # new root key) roll at most this many models at a time; "manual": each waits for the CR
    # annotation inflight.dev/rollout=approved; "unlimited": no gate (``rollout_gate``).
    max_concurrent_rollouts: int | str = 1
    # Read the children from watch-fed caches (``informer``: one list+watch per kind per namespace)
    # instead of a GET per child per tick; off only to measure the difference (bench/studies/operator_api_load.py).
    watch_children: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_concurrent_rollouts", rollout_gate.parse_limit(self.max_concurrent_rollouts))
        if self.activator_pods:
            scale_to_zero.parse_selector(self.activator_pods)
        if isinstance(self.full_check_every_ticks, bool) or not isinstance(self.full_check_every_ticks, int) \
                or self.full_check_every_ticks < 1:
            raise ValueError(f"OperatorConfig.full_check_every_ticks must be an integer >= 1 "
                             f"(got {self.full_check_every_ticks!r}).")
        for name in ("tick_seconds", "pod_timeout_seconds", "lease_seconds", "api_timeout_seconds",
                     "retry_base_seconds", "retry_max_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"OperatorConfig.{name} must be a number > 0 (got {value!r}).")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        port = env_vars.read_str("INFLIGHT_OPERATOR_LIVENESS_PORT", env) or ""
        if not port.isdigit() or int(port) > 65535:
            raise ValueError(f"INFLIGHT_OPERATOR_LIVENESS_PORT must be a port number (got {port!r}).")
        return cls(
            tick_seconds=env_vars.read_float("INFLIGHT_OPERATOR_TICK_SECONDS", env),  # type: ignore[arg-type]
            pod_timeout_seconds=env_vars.read_float("INFLIGHT_OPERATOR_POD_TIMEOUT_SECONDS", env),  # type: ignore[arg-type]
            lease_name=env_vars.read_str("INFLIGHT_OPERATOR_LEASE_NAME", env) or "",
            lease_namespace=env.get("POD_NAMESPACE", "default"),
            identity=env.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
            liveness_port=int(port),
            lease_seconds=env_vars.read_float("INFLIGHT_OPERATOR_LEASE_SECONDS", env),  # type: ignore[arg-type]
            root_secret=env_vars.read_str("INFLIGHT_OPERATOR_ROOT_SECRET", env) or "",
            api_timeout_seconds=env_vars.read_float("INFLIGHT_OPERATOR_API_TIMEOUT_SECONDS", env),  # type: ignore[arg-type]
            retry_base_seconds=env_vars.read_float("INFLIGHT_OPERATOR_RETRY_BASE_SECONDS", env),  # type: ignore[arg-type]
            retry_max_seconds=env_vars.read_float("INFLIGHT_OPERATOR_RETRY_MAX_SECONDS", env),  # type: ignore[arg-type]
            full_check_every_ticks=env_vars.read_int("INFLIGHT_OPERATOR_FULL_CHECK_EVERY_TICKS", env),  # type: ignore[arg-type]
            activator_url=env_vars.read_str("INFLIGHT_OPERATOR_ACTIVATOR_URL", env) or "",
            activator_pods=env_vars.read_str("INFLIGHT_OPERATOR_ACTIVATOR_PODS", env) or "",
            max_concurrent_rollouts=env_vars.read_str("INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS", env) or "",
        )


def default_login(settings: kopf.OperatorSettings) -> LoginFn:
    """kopf's own login through the ``kubernetes`` package (``kopf.login_via_client``, what kopf
    does by default when that package is installed): the in-cluster service account, else the
    kubeconfig with everything that package understands (exec plugins such as
    ``gke-gcloud-auth-plugin`` and ``aws eks get-token``, auth providers, OIDC). kopf's minimal
    loaders (``login_with_kubeconfig``) run no exec plugin, so a GKE/EKS kubeconfig fails there.
    ``None`` when neither works (kopf then stops with "no credentials")."""
    logger = logging.getLogger("inflight.operator.login")

    def login() -> kopf.ConnectionInfo | None:
        try:
            return kopf.login_via_client(logger=logger, settings=settings)
        except kopf.LoginError as exc:
            logger.error("%s", exc)
            return None

    return login


class OperatorContext:
    """The operator's clients; created by the startup handler, closed by cleanup."""

    def __init__(self, config: OperatorConfig, login: LoginFn | None = None,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        self.config = config
        self.login = login
        # Losing the leader Lease: exit at once (as client-go's leader election does), so the
        # new leader never overlaps with this process's handlers; the kubelet restarts it as a
        # candidate. Tests pass a callback that stops their in-process operator instead.
        self.on_lease_lost = on_lease_lost or _exit_lost
        self.connection: kopf.ConnectionInfo | None = None
        self._kube: KubeClient | None = None
        self._retired: list[KubeClient] = []
        self._http: aiohttp.ClientSession | None = None
        self._root_key: bytes | None = None
        self.rollout_lock = asyncio.Lock()  # admissions at the rollout gate, one at a time
        self.informers = Informers(lambda: self.kube) if config.watch_children else None

    async def admin_key(self, namespace: str, name: str) -> tuple[str, str]:
        """(the admin key of ``namespace/name``, the root key's id); the root is read (or
        created) once from the operator's own namespace."""
        if self._root_key is None:
            self._root_key = await admin_keys.load_or_create_root(
                self.kube, self.config.lease_namespace, self.config.root_secret)
        return admin_keys.derive(self._root_key, namespace, name), admin_keys.key_id(self._root_key)

    def set_connection(self, conn: kopf.ConnectionInfo) -> None:
        """Called on every (re-)login; later requests use the new credentials."""
        if self._kube is not None and conn != self.connection:
            self._retired.append(self._kube)
            self._kube = None
        self.connection = conn

    @property
    def kube(self) -> KubeClient:
        if self._kube is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
            self._kube = KubeClient(self.connection, self.config.api_timeout_seconds)
            if self.informers is not None:
                self._kube.observers.append(self.informers.observe)
        return self._kube

    @property
    def cache(self) -> Informers | KubeClient:
        """Where the timer reads the children (``get``/``list``): the watch-fed caches, or the API
        server itself when ``watch_children`` is off."""
        return self.informers if self.informers is not None else self.kube

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self.informers is not None:
            await self.informers.close()
        for client in [*self._retired, *([self._kube] if self._kube else [])]:
            await client.close()
        self._retired.clear()
        if self._http is not None:
            await self._http.close()
        self._kube = self._http = None


def _exit_lost() -> None:
    logging.getLogger("inflight.operator").critical("lost the leader Lease: exiting so the new leader acts alone")
    os._exit(1)
