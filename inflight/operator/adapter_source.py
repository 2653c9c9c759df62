"""LoRA adapters of a deployment: ``spec.adapters`` parsed into ``Adapter`` values, and where each
adapter's files are inside the runtime container.

Owns the adapter vocabulary (a DNS-label name, unique and not the base model's served name;
exactly one source: ``hf`` {repo, revision, tokenSecret}, ``pvc`` {claimName, path} or ``image``
{reference, path}), ``enable_lora`` following the adapters, the in-container path the runtime
is given as ``lora_path``, and the volume names and mount path the adapter sources take. Knows nothing about manifests, HTTP or I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from inflight.operator import engine_args, fields
from inflight.operator.model_source import HF_REPO_ID, HF_REVISION, ModelSource, SecretKeyRef
from inflight.operator.render_model import MODEL_MOUNT

ADAPTER_SOURCES = ("hf", "pvc", "image")
ADAPTERS_MOUNT = "/adapters"  # pvc claims and the per-pod adapter directory are mounted under it
ADAPTER_CACHE_DIR = "adapters"  # hf adapters beside the model in a shared cache: /models/adapters/...
# The files a PEFT adapter is made of (adapter_config.json, adapter_model.safetensors).
ADAPTER_HF_PATTERNS = ("*.json", "*.safetensors")
MAX_ADAPTERS = 256


@dataclass(frozen=True, slots=True)
class HfAdapter:
    repo: str
    revision: str = "main"
    token: SecretKeyRef | None = None


@dataclass(frozen=True, slots=True)
class PvcAdapter:
    claim_name: str
    path: str = ""


@dataclass(frozen=True, slots=True)
class ImageAdapter:
    reference: str
    path: str


@dataclass(frozen=True, slots=True)
class Adapter:
    """One entry of ``spec.adapters``: exactly one of ``hf``, ``pvc``, ``image`` is set."""

    name: str
    hf: HfAdapter | None = None
    pvc: PvcAdapter | None = None
    image: ImageAdapter | None = None

    @property
    def source(self) -> HfAdapter | PvcAdapter | ImageAdapter:
        found = self.hf or self.pvc or self.image
        if found is None:
            raise ValueError(f"adapter {self.name!r} has no source")
        return found


def parse_adapters(raw: Any, served_model_name: str) -> tuple[Adapter, ...]:
    """``spec.adapters`` -> adapters; ``ValueError`` naming the entry and the field."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(a, dict) for a in raw):
        raise ValueError("spec.adapters must be a list of objects ({name, source}).")
    if len(raw) > MAX_ADAPTERS:
        raise ValueError(f"spec.adapters has {len(raw)} entries; at most {MAX_ADAPTERS}.")
    adapters: list[Adapter] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw):
        p = f"spec.adapters[{i}]"
        name = fields.matching(fields.string(entry, "name", None, p), fields.DNS_LABEL, f"{p}.name", "sql-lora")
        if name in seen:
            raise ValueError(f"{p}.name {name!r} is used twice; adapter names must be unique.")
        if name == served_model_name:
            raise ValueError(f"{p}.name {name!r} is the base model's served name; requests could not tell "
                             "them apart. Pick another name.")
        seen.add(name)
        adapters.append(_parse_source(name, fields.obj(entry, "source", p, required=True), f"{p}.source"))
    return tuple(adapters)


def check_adapter_mounts(volumes: tuple[dict[str, Any], ...], mounts: tuple[dict[str, Any], ...]) -> None:
    """With LoRA on, ``/adapters`` and the ``adapters-*`` volumes are the operator's (``render_adapters``):
    ``spec.volumes``/``volumeMounts`` that take them are refused."""
    for i, vol in enumerate(volumes):
        if str(vol.get("name", "")).startswith("adapters-"):
            raise ValueError(f"spec.volumes[{i}].name {vol.get('name')!r}: names adapters-* are the operator's "
                             "with LoRA on (spec.adapters); pick another name.")
    for i, mount in enumerate(mounts):
        path = str(mount.get("mountPath", "")).rstrip("/")
        if path == ADAPTERS_MOUNT or path.startswith(ADAPTERS_MOUNT + "/"):
            raise ValueError(f"spec.volumeMounts[{i}].mountPath {path!r} is inside {ADAPTERS_MOUNT}, where the "
                             "operator mounts the adapters with LoRA on; mount it elsewhere.")


def with_lora(engine: dict[str, Any], adapters: tuple[Adapter, ...]) -> dict[str, Any]:
    """``enable_lora`` is on when adapters are listed (``enableLora: true`` alone starts the pods
    ready for adapters added later without a restart); ``enableLora: false`` beside adapters is refused."""
    if not adapters:
        return engine
    if engine.get("enable_lora") is False:
        raise ValueError("spec.engine.enableLora is false but spec.adapters lists adapters; drop enableLora "
                         "(it follows the adapters) or the adapters.")
    filled = {**engine, "enable_lora": True}
    try:  # as the pod will run it: LoRA refuses some other options
        engine_args.validate_engine(filled)
    except ValueError as exc:
        raise ValueError(f"{exc} (spec.adapters turns enableLora on)") from exc
    return filled


def _parse_source(name: str, raw: dict[str, Any], p: str) -> Adapter:
    kinds = [k for k in ADAPTER_SOURCES if raw.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(f"{p} needs exactly one of {', '.join(ADAPTER_SOURCES)} (got {', '.join(kinds) or 'none'}).")
    kind = kinds[0]
    src, sp = fields.obj(raw, kind, p), f"{p}.{kind}"
    if kind == "hf":
        repo = fields.matching(fields.string(src, "repo", None, sp), HF_REPO_ID, f"{sp}.repo", "org/my-lora")
        revision = fields.matching(fields.string(src, "revision", "main", sp), HF_REVISION, f"{sp}.revision",
                                   "main or a 40-character commit hash")
        if ".." in revision.split("/"):
            raise ValueError(f"{sp}.revision must not contain '..' (got {revision!r}).")
        token = None
        if src.get("tokenSecret") is not None:
            ref, rp = fields.obj(src, "tokenSecret", sp), f"{sp}.tokenSecret"
            token = SecretKeyRef(
                name=fields.matching(fields.string(ref, "name", None, rp), fields.DNS_SUBDOMAIN, f"{rp}.name",
                                     "hf-token"),
                key=fields.matching(fields.string(ref, "key", "token", rp), fields.SECRET_KEY, f"{rp}.key", "token"))
        return Adapter(name=name, hf=HfAdapter(repo=repo, revision=revision, token=token))
    if kind == "pvc":
        claim = fields.matching(fields.string(src, "claimName", None, sp), fields.DNS_SUBDOMAIN, f"{sp}.claimName",
                                "lora-adapters")
        return Adapter(name=name, pvc=PvcAdapter(claim_name=claim, path=_relative(src, "path", "", sp)))
    reference = fields.string(src, "reference", None, sp)
    if not reference or any(c.isspace() for c in reference):
        raise ValueError(f"{sp}.reference must be an image reference like repo/name:tag (got {reference!r}).")
    path = fields.string(src, "path", None, sp)
    if not path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"{sp}.path must be an absolute directory inside the image, without '..' (got {path!r}).")
    return Adapter(name=name, image=ImageAdapter(reference=reference, path=path))


def _relative(raw: dict[str, Any], key: str, default: str, p: str) -> str:
    value = fields.string(raw, key, default, p).strip("/")
    if ".." in value.split("/") or any(c in value for c in "\n\0"):
        raise ValueError(f"{p}.{key} must be a directory inside the volume, without '..' (got {raw.get(key)!r}).")
    return value


def pvc_volume_name(claim_name: str) -> str:
    """The pod volume of an adapter PVC (a DNS label whatever the claim's length)."""
    return "adapters-" + hashlib.sha256(claim_name.encode()).hexdigest()[:12]


def hf_in_model_cache(model: ModelSource) -> bool:
    """hf adapters land in the model's shared cache PVC beside the model (downloaded once per
    cache, not once per pod) when the model is an hf source with a shared cache."""
    return model.hf is not None and model.cache is not None and model.cache.shared


def adapter_path(adapter: Adapter, model: ModelSource) -> str:
    """The adapter's directory in the runtime container (the ``lora_path`` it is loaded from)."""
    if adapter.pvc is not None:
        base = f"{ADAPTERS_MOUNT}/pvc/{adapter.pvc.claim_name}"
        return f"{base}/{adapter.pvc.path}" if adapter.pvc.path else base
    if adapter.hf is not None:
        sub = f"hf/{adapter.hf.repo.replace('/', '--')}/{adapter.hf.revision.replace('/', '--')}"
        if hf_in_model_cache(model):
            return f"{MODEL_MOUNT}/{ADAPTER_CACHE_DIR}/{sub}"
        return f"{ADAPTERS_MOUNT}/local/{sub}"
    return f"{ADAPTERS_MOUNT}/local/image/{adapter.name}"
