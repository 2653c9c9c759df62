{{/* Names, labels and the operator's RBAC rules. */}}

{{- define "inflight.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inflight.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "inflight.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inflight.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "inflight.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "inflight.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: inflight
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "inflight.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "inflight.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace the operator watches, or "" for all of them. */}}
{{- define "inflight.watchNamespace" -}}
{{- include "inflight.watchNamespaces" . | fromJsonArray | join "," -}}
{{- end -}}

{{/* watchNamespace and watchNamespaces together, as a JSON list ([] in cluster mode). */}}
{{- define "inflight.watchNamespaces" -}}
{{- $list := .Values.watchNamespaces | default list -}}
{{- if .Values.watchNamespace -}}
{{- $list = prepend $list .Values.watchNamespace -}}
{{- end -}}
{{- $list | uniq | toJson -}}
{{- end -}}

{{/*
RBAC rules, split by scope. They must equal inflight.operator.rbac.REQUIRED_PERMISSIONS
(tests/chart/test_rbac.py fails when they drift). Cluster-scoped resources can only be granted
by a ClusterRole; namespaced ones go in a Role when watchNamespace is set.
*/}}
{{- define "inflight.rules.clusterScoped" -}}
# kopf: resource discovery, and namespace observation in namespaced mode.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}

{{- define "inflight.rules.namespaced" -}}
# The custom resource: kopf watches it and patches finalizers/annotations; status is patched.
- apiGroups: ["inflight.dev"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["inflight.dev"]
  resources: ["inferencedeployments/status"]
  verbs: ["get", "patch"]
# Children have blockOwnerDeletion owner references (OwnerReferencesPermissionEnforcement).
- apiGroups: ["inflight.dev"]
  resources: ["inferencedeployments/finalizers"]
  verbs: ["update"]
# The objects rendered for each InferenceDeployment (owned by it; list and watch: the caches
# the operator reads them from instead of polling).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Runtime pods are watched to scrape /metrics, push live config and read the model download state.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# spec.adapters: the operator sets the pods' readiness gate inflight.dev/adapters-loaded.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# The admin Secret (<name>-admin) is written with a derived key and deleted with its owner,
# never read; the model-cache PVC is created once, read, deleted with its owner.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "delete"]
# spec.inferencePool: the Gateway API Inference Extension's InferencePool.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.nodes > 1: the LeaderWorkerSet (leaderworkerset.x-k8s.io) running the groups.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Scaling decisions, refusals and foreign autoscalers; listed while a pod is stuck creating.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
# An HPA (or KEDA's) on a child Deployment is reported, not fought; spec.autoscaling.partner
# kind: hpa renders one (kind: keda, a KEDA ScaledObject).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The endpoint picker's ServiceAccount and RoleBinding (rbac.picker): bind on its ClusterRole only.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- if .Values.rbac.picker }}
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  resourceNames: [{{ include "inflight.fullname" . }}-epp]
  verbs: ["bind"]
{{- end }}
{{- end -}}

{{- define "inflight.rules.picker" -}}
# What llm-d's router picker (and GIE's epp) reads and writes in its namespace.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["inference.networking.x-k8s.io", "llm-d.ai"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
# --ha-enable-leader-election (endpointPicker.replicas > 1).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{- define "inflight.rules.ownNamespace" -}}
# inflight.operator.rbac.OWN_NAMESPACE_PERMISSIONS: the leader-election Lease; the pre-delete
# hook scales the operator's Deployment to 0 and waits for its pods to go.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "patch"]
# The admin keys' root Secret: readable by its name only; created on first start.
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: [{{ include "inflight.fullname" . }}-root-key]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# The rollout gate's ledger (ConfigMap inflight-operator-rollouts): operator-caused rollouts in progress.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
{{- end -}}
