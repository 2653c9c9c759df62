"""What the kmock harness serves so that the real ``kubectl`` can work against it: OpenAPI v3
documents built from the stored CRDs, and server-side strict field validation of custom objects.

``kubectl apply``/``create`` validate a manifest either client-side (with the OpenAPI v2
protobuf document, which this harness does not serve) or, when the server's OpenAPI v3 says the
PATCH operation of that kind takes the ``fieldValidation`` query parameter, server-side by
sending ``?fieldValidation=Strict``. The harness advertises that parameter for every CRD kind
and does what a real API server does with it for custom resources: the object is checked
against the CRD's ``openAPIV3Schema`` (types, enums, bounds, required) and fields the schema
does not know are an error instead of being pruned. Defaults are applied as the API server
applies them to a structural schema (:func:`apply_defaults`); CEL rules are not run.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

CrdSchemas = dict[str, tuple[str, str, str, dict[str, Any]]]  # "group/version" -> (kind, plural, version, schema)


def crd_schemas(crds: list[dict[str, Any]]) -> CrdSchemas:
    out: CrdSchemas = {}
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            out[f"{spec['group']}/{version['name']}"] = (
                spec["names"]["kind"], spec["names"]["plural"], version["name"], version["schema"]["openAPIV3Schema"])
    return out


def openapi_root(schemas: CrdSchemas) -> dict[str, Any]:
    return {"paths": {
        f"apis/{gv}": {"serverRelativeURL": f"/openapi/v3/apis/{gv}?hash={abs(hash(repr(s)))}"}
        for gv, s in schemas.items()
    }}


def openapi_group_version(schemas: CrdSchemas, gv: str) -> dict[str, Any] | None:
    if gv not in schemas:
        return None
    kind, plural, version, schema = schemas[gv]
    group = gv.rsplit("/", 1)[0]
    name = ".".join(reversed(group.split("."))) + f".{version}.{kind}"
    gvk = {"group": group, "version": version, "kind": kind}
    field_validation = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
    ref = {"200": {"description": "OK", "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}
    operation = {"x-kubernetes-group-version-kind": gvk, "parameters": [field_validation], "responses": ref}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (kmock harness)", "version": "v1.30.0"},
        "paths": {
            f"/apis/{gv}/namespaces/{{namespace}}/{plural}": {"post": dict(operation)},
            f"/apis/{gv}/namespaces/{{namespace}}/{plural}/{{name}}": {"patch": dict(operation),
                                                                        "put": dict(operation)},
        },
        "components": {"schemas": {name: {**schema, "x-kubernetes-group-version-kind": [gvk]}}},
    }


def strict_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Schema violations and unknown fields of ``obj``, as ``path: message`` lines."""
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft4Validator(schema).iter_errors(obj)
    ]
    errors += [f'unknown field "{path}"' for path in _unknown(obj, schema, "")]
    return errors


def _unknown(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(schema, dict):
        return []
    out: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            path = f"{where}.{key}" if where else key
            if key not in schema["properties"]:
                if where != "metadata" and not (where == "" and key in ("apiVersion", "kind", "metadata")):
                    out.append(path)
                continue
            out += _unknown(sub, schema["properties"][key], path)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, sub in value.items():
            out += _unknown(sub, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _unknown(item, schema["items"], f"{where}[{i}]")
    return out


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with the schema's ``default``s filled in where a field is missing, as the API
    server defaults custom resources (in objects that exist, recursively, in list items too;
    a default itself is defaulted further). Returns a new value."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out and out[key] is not None:
                out[key] = apply_defaults(out[key], sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value
