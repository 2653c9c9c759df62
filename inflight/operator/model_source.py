"""Where a deployment's weights come from: ``spec.model`` parsed into a ``ModelSource``.

Owns the model-source vocabulary (exactly one of ``pvc``, ``hostPath``, ``image``, ``hf``),
the Hugging Face source (repo id, revision, token Secret, file patterns) and its model cache
(an existing PVC, a PVC the operator creates, or none: a per-pod emptyDir), and where in the
cache volume a repo/revision lives (``hf_cache_subdir``), which the init container and the
runtime container must agree on. Knows nothing about manifests or I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inflight.operator import fields

SOURCES = ("pvc", "hostPath", "image", "hf")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")
# The files the runtime loads (config, weights, tokenizer, chat template); nothing else.
DEFAULT_HF_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][-._A-Za-z0-9]{0,95}(/[A-Za-z0-9][-._A-Za-z0-9]{0,95})?$")
HF_REVISION = re.compile(r"^[-._/A-Za-z0-9]{1,255}$")


@dataclass(frozen=True, slots=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True, slots=True)
class HfSource:
    repo_id: str
    revision: str = "main"
    token: SecretKeyRef | None = None
    allow_patterns: tuple[str, ...] = DEFAULT_HF_PATTERNS
    image: str | None = None  # image that runs the download (default: the runtime image)
    endpoint: str | None = None  # a Hub mirror (HF_ENDPOINT); default huggingface.co


@dataclass(frozen=True, slots=True)
class ModelCache:
    """The volume an ``hf`` source downloads into, shared by the replicas when it is a PVC."""

    claim_name: str | None = None  # an existing PVC (the operator never deletes it)
    size: str | None = None  # or: the operator creates ``<name>-model-cache`` of this size
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteOnce"

    @property
    def shared(self) -> bool:
        return self.claim_name is not None or self.size is not None


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the weights come from: exactly one of pvc, host_path, image, hf."""

    served_model_name: str
    pvc_claim_name: str | None = None
    host_path: str | None = None
    image: str | None = None
    path: str = ""  # inside the volume / the image
    hf: HfSource | None = None
    cache: ModelCache | None = None  # set (possibly an emptyDir cache) exactly when hf is


def hf_cache_subdir(hf: HfSource) -> str:
    """The model's directory inside the cache volume: ``hf/<org>--<name>/<revision>``."""
    return f"hf/{hf.repo_id.replace('/', '--')}/{hf.revision.replace('/', '--')}"


def parse_model(name: str, raw: dict) -> ModelSource:
    p = "spec.model"
    sources = [k for k in SOURCES if raw.get(k) is not None]
    if len(sources) != 1:
        raise ValueError(f"{p} needs exactly one of {', '.join(SOURCES)} (got {', '.join(sources) or 'none'}).")
    kind = sources[0]
    source = fields.obj(raw, kind, p)
    served = fields.string(raw, "servedModelName", name, p)
    if raw.get("cache") is not None and kind != "hf":
        raise ValueError(f"{p}.cache is only used with {p}.hf (the other sources need no download).")
    if kind == "pvc":
        return ModelSource(
            served_model_name=served,
            pvc_claim_name=fields.string(source, "claimName", None, f"{p}.pvc"),
            path=fields.string(source, "path", "", f"{p}.pvc"),
        )
    if kind == "hostPath":
        path = fields.string(source, "path", None, f"{p}.hostPath")
        if not path.startswith("/"):
            raise ValueError(f"{p}.hostPath.path must be an absolute path (got {path!r}).")
        return ModelSource(served_model_name=served, host_path=path)
    if kind == "image":
        return ModelSource(
            served_model_name=served,
            image=fields.string(source, "image", None, f"{p}.image"),
            path=fields.string(source, "path", None, f"{p}.image"),
        )
    return ModelSource(
        served_model_name=served, hf=_parse_hf(source), cache=_parse_cache(fields.obj(raw, "cache", p))
    )


def _parse_hf(raw: dict) -> HfSource:
    p = "spec.model.hf"
    repo_id = fields.matching(fields.string(raw, "repoId", None, p), HF_REPO_ID, f"{p}.repoId",
                              "HuggingFaceTB/SmolLM2-135M-Instruct")
    revision = fields.matching(fields.string(raw, "revision", fields.default(HfSource, "revision"), p),
                               HF_REVISION, f"{p}.revision",
                               "main or a 40-character commit hash")
    if ".." in revision.split("/"):
        raise ValueError(f"{p}.revision must not contain '..' (got {revision!r}).")
    token = None
    if raw.get("tokenSecretRef") is not None:
        ref = fields.obj(raw, "tokenSecretRef", p)
        token = SecretKeyRef(
            name=fields.string(ref, "name", None, f"{p}.tokenSecretRef"),
            key=fields.string(ref, "key", "token", f"{p}.tokenSecretRef"),
        )
    patterns = raw.get("allowPatterns", list(DEFAULT_HF_PATTERNS))
    if not isinstance(patterns, list) or not patterns or not all(isinstance(x, str) and x for x in patterns):
        raise ValueError(f"{p}.allowPatterns must be a non-empty list of glob strings (e.g. ['*.json']).")
    endpoint = fields.optional_string(raw, "endpoint", p)
    if endpoint is not None and not endpoint.startswith(("https://", "http://")):
        raise ValueError(f"{p}.endpoint must be an http(s) URL such as https://hf-mirror.example.com (got {endpoint!r}).")
    return HfSource(repo_id=repo_id, revision=revision, token=token, allow_patterns=tuple(patterns),
                    image=fields.optional_string(raw, "image", p), endpoint=endpoint)


def _parse_cache(raw: dict) -> ModelCache:
    p = "spec.model.cache"
    claim = fields.optional_string(raw, "claimName", p)
    size = fields.quantity(raw, "size", p)
    if claim is not None and size is not None:
        raise ValueError(f"{p}: set claimName (an existing PVC) or size (the operator creates one), not both.")
    storage_class = fields.optional_string(raw, "storageClassName", p)
    # Stock default classes (GKE standard-rwo, EKS gp2/gp3, AKS managed-csi) offer no RWX: a
    # shared cache needs a class that does (Filestore, EFS, Azure Files, CephFS, NFS).
    mode = fields.string(raw, "accessMode", "ReadWriteMany" if storage_class else "ReadWriteOnce", p)
    if mode not in ACCESS_MODES:
        raise ValueError(f"{p}.accessMode must be one of {', '.join(ACCESS_MODES)} (got {mode!r}).")
    if mode == "ReadWriteMany" and size is not None and storage_class is None:
        raise ValueError(
            f"{p}.accessMode ReadWriteMany needs {p}.storageClassName naming a class that offers it "
            "(e.g. Filestore on GKE, EFS on EKS, Azure Files): the default classes of GKE, EKS and AKS "
            "are ReadWriteOnce and the PVC would stay Pending. Without a class the cache is ReadWriteOnce "
            "(pods on one node share it).")
    if claim is not None and (storage_class is not None or "accessMode" in raw):
        raise ValueError(f"{p}.storageClassName and accessMode apply only to a cache the operator creates (size).")
    return ModelCache(claim_name=claim, size=size, storage_class_name=storage_class, access_mode=mode)
