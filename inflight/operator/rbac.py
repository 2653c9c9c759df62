"""The Kubernetes permissions the operator needs: the contract the Helm chart's RBAC is tested against.

Owns ``REQUIRED_PERMISSIONS``: every API call the operator makes, its own (``kube.py``)
and kopf's (watching the custom resource, patching its status/finalizers/annotations,
posting Events, observing CRDs and namespaces). A kmock test records every request the
operator sends and checks each is covered here, so the list stays true to the code.
Knows nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Permission:
    api_group: str  # "" for the core group
    resource: str  # plural, optionally "plural/subresource"
    verbs: tuple[str, ...]


REQUIRED_PERMISSIONS: tuple[Permission, ...] = (
    # The custom resource: kopf lists/watches it and patches finalizers and annotations;
    # the operator patches status (the status subresource).
    Permission("inflight.dev", "inferencedeployments", ("get", "list", "watch", "patch")),
    Permission("inflight.dev", "inferencedeployments/status", ("get", "patch")),
    # Children carry blockOwnerDeletion owner references: with OwnerReferencesPermissionEnforcement
    # (OpenShift, hardened clusters) creating them needs update on the owner's finalizers.
    Permission("inflight.dev", "inferencedeployments/finalizers", ("update",)),
    # Children, owned by the custom resource (create; get and patch on 409; list and watch: the
    # caches the timer reads them from, ``informer``; patch to repair drift; delete on delete).
    Permission("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete")),
    Permission("", "services", ("get", "list", "watch", "create", "patch", "delete")),
    Permission("policy", "poddisruptionbudgets", ("get", "list", "watch", "create", "patch", "delete")),
    Permission("", "configmaps", ("get", "list", "watch", "create", "patch", "delete")),
    # Pods are watched to scrape /metrics, push live config and read the model download's state.
    Permission("", "pods", ("list", "watch")),
    # spec.adapters: the readiness gate inflight.dev/adapters-loaded, set once a pod has every adapter.
    Permission("", "pods/status", ("patch",)),
    # The admin Secret (<name>-admin) is written with a derived key (admin_keys) and deleted
    # with its owner; never read: no Secret outside the operator's namespace is readable.
    Permission("", "secrets", ("create", "delete")),
    # The model-cache PVC (<name>-model-cache, spec.model.cache.size) is created once.
    Permission("", "persistentvolumeclaims", ("get", "list", "watch", "create", "delete")),
    # spec.inferencePool: the InferencePool (the picker's Deployment/Service are covered above).
    Permission("inference.networking.k8s.io", "inferencepools", ("get", "list", "watch", "create", "patch", "delete")),
    # The endpoint picker's ServiceAccount and its RoleBinding to the chart's picker ClusterRole (the
    # chart grants ``bind`` on that ClusterRole alone, so the operator hands out no right it lacks).
    Permission("", "serviceaccounts", ("get", "list", "watch", "create", "patch", "delete")),
    Permission("rbac.authorization.k8s.io", "rolebindings", ("get", "list", "watch", "create", "patch", "delete")),
    # Checked by the API server when that RoleBinding is created (the chart limits it to resourceNames
    # [<release>-epp]); the operator sends no request of its own for it.
    Permission("rbac.authorization.k8s.io", "clusterroles", ("bind",)),
    # spec.nodes > 1: the LeaderWorkerSet that runs the groups (its replicas are the autoscaler's).
    Permission("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "list", "watch", "create", "patch", "delete")),
    # Scaling decisions, refusals and foreign autoscalers are posted as Events by the operator
    # itself (kopf posts none for a failed handler or timer).
    # Listed (in a namespace) only while a pod is stuck creating: why its volumes do not attach.
    Permission("", "events", ("create", "list")),
    # A HorizontalPodAutoscaler (or KEDA's) targeting a child Deployment is reported, not fought;
    # spec.autoscaling.partner renders one (kind: hpa) or a KEDA ScaledObject (kind: keda).
    Permission("autoscaling", "horizontalpodautoscalers", ("get", "list", "watch", "create", "patch", "delete")),
    Permission("keda.sh", "scaledobjects", ("get", "list", "watch", "create", "patch", "delete")),
    # kopf's cluster observation (resource discovery; namespaces only in namespaced mode).
    Permission("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
    Permission("", "namespaces", ("list", "watch")),
)


# Granted only in the operator's own namespace (a Role there, never cluster-wide): the leader
# election Lease, and, for the chart's pre-delete hook (``inflight.operator.uninstall``),
# scaling the operator's own Deployment to 0 and watching its pods go.
OWN_NAMESPACE_PERMISSIONS: tuple[Permission, ...] = (
    Permission("coordination.k8s.io", "leases", ("get", "create", "patch")),
    # The admin keys' root (admin_keys): read (the chart limits get to its name), created once.
    Permission("", "secrets", ("get", "create")),
    Permission("apps", "deployments", ("patch",)),
    # The hook's wait for the operator's pods, and the activator's replicas (activator_fleet: each
    # is asked for its demand at its pod IP).
    Permission("", "pods", ("list",)),
    # The rollout gate's ledger (ConfigMap inflight-operator-rollouts): rollouts in progress.
    Permission("", "configmaps", ("get", "create", "patch")),
)


def allows(group: str, resource: str, verb: str, own_namespace: bool = False) -> bool:
    """Whether ``verb`` on ``group``/``resource`` is granted: by REQUIRED_PERMISSIONS anywhere,
    and by OWN_NAMESPACE_PERMISSIONS too when the request is in the operator's own namespace."""
    granted = (*REQUIRED_PERMISSIONS, *(OWN_NAMESPACE_PERMISSIONS if own_namespace else ()))
    return any(p.api_group == group and p.resource == resource and verb in p.verbs for p in granted)
