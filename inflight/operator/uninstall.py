"""``python -m inflight.operator.uninstall``: what the chart's pre-delete hook runs, so that
deleting an InferenceDeployment after ``helm uninstall`` does not hang on the operator's
finalizer.

Owns the two steps: stop the operator (scale its Deployment to 0 and wait until none of its
pods is left, so nothing adds the finalizer back), then remove ``inflight.dev/finalizer`` from
every InferenceDeployment it watched (guarded by resourceVersion, retried on a conflict). The
resources and their pods keep running; their children carry owner references, so Kubernetes'
garbage collector deletes them with the resource when it is deleted later. Knows nothing about
reconciling.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

import kopf

from inflight.operator.kube import DEPLOYMENTS, INFERENCE_DEPLOYMENTS, PODS, KubeClient, KubeError

FINALIZER = "inflight.dev/finalizer"
logger = logging.getLogger("inflight.operator.uninstall")


async def stop_operator(kube: KubeClient, namespace: str, name: str, pod_labels: dict[str, str],
                        timeout_s: float = 120.0) -> None:
    """Scale the operator's Deployment to 0 and wait until its pods are gone."""
    try:
        await kube.patch(DEPLOYMENTS, namespace, name, {"spec": {"replicas": 0}})
    except KubeError as exc:
        if exc.status != 404:
            raise
        return  # already gone
    deadline = time.monotonic() + timeout_s
    while await kube.list(PODS, namespace, pod_labels):
        if time.monotonic() > deadline:
            raise TimeoutError(f"operator pods in {namespace} still running after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def release_finalizers(kube: KubeClient, namespace: str | None, attempts: int = 5) -> list[str]:
    """Remove the operator's finalizer from every InferenceDeployment; "ns/name" of each."""
    released = []
    for obj in await kube.list_all(INFERENCE_DEPLOYMENTS, namespace):
        meta = obj["metadata"]
        for _ in range(attempts):
            finalizers = list(meta.get("finalizers") or [])
            if FINALIZER not in finalizers:
                break
            patch = {"metadata": {"finalizers": [f for f in finalizers if f != FINALIZER] or None,
                                  "resourceVersion": meta.get("resourceVersion")}}
            try:
                await kube.patch(INFERENCE_DEPLOYMENTS, meta["namespace"], meta["name"], patch)
                released.append(f"{meta['namespace']}/{meta['name']}")
                break
            except KubeError as exc:
                if exc.status == 404:
                    break
                if exc.status != 409:
                    raise
                fresh = await kube.get(INFERENCE_DEPLOYMENTS, meta["namespace"], meta["name"])
                if fresh is None:
                    break
                meta = fresh["metadata"]
    return released


async def run(conn: kopf.ConnectionInfo, args: argparse.Namespace) -> list[str]:
    kube = KubeClient(conn)
    try:
        if args.operator_deployment:
            labels = dict(item.split("=", 1) for item in args.operator_selector.split(",") if item)
            await stop_operator(kube, args.operator_namespace, args.operator_deployment, labels)
        released: list[str] = []
        for namespace in args.watch_namespace or [None]:  # None: every namespace
            released += await release_finalizers(kube, namespace)
        return released
    finally:
        await kube.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.operator.uninstall", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    parser.add_argument("--operator-deployment", default="", help="scale this Deployment to 0 first")
    parser.add_argument("--operator-selector", default="", help="its pods' labels, k=v,k=v")
    parser.add_argument("--watch-namespace", action="append", default=[],
                        help="only this namespace (repeatable; default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    conn = kopf.login_via_client(logger=logger, settings=kopf.OperatorSettings())
    if conn is None:
        print("no Kubernetes credentials (in-cluster service account or kubeconfig)", file=sys.stderr)
        return 1
    released = asyncio.run(run(conn, args))
    print(f"released {len(released)} InferenceDeployment(s): {', '.join(released) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
