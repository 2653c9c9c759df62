"""The chart's pre-delete hook (``inflight.operator.uninstall``) against kmock: it scales the
operator to 0, waits for its pods to go, and takes the finalizer off every InferenceDeployment,
so a delete after ``helm uninstall`` completes and the garbage collector takes the children."""

from __future__ import annotations

import argparse
import asyncio

import kopf

from inflight.operator import uninstall
from inflight.operator.kube import KubeClient
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import api_server, start_operator, uncovered_requests, wait_for

NAME = "llama-minimal"
CR = f"/apis/inflight.dev/v1alpha1/namespaces/default/inferencedeployments/{NAME}"
OP_NS = "inflight-system"
OP_LABELS = {"app.kubernetes.io/name": "inflight-operator", "app.kubernetes.io/instance": "inflight"}


def test_uninstall_hook_releases_finalizers_so_a_later_delete_completes() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            operator = start_operator(cluster)
            await asyncio.wait_for(operator.ready.wait(), 10)
            await cluster.create_cr(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))

            async def finalized() -> bool:
                cr = await cluster.cr(NAME)
                return bool(cr) and uninstall.FINALIZER in (cr["metadata"].get("finalizers") or [])

            await wait_for(finalized, what="kopf's finalizer on the resource")
            await wait_for(lambda: cluster.child("poddisruptionbudgets", NAME), what="children")
            await operator.shutdown()  # what the hook's scale-to-0 does to the real one

            # The operator's own Deployment and pod, and a stand-in for its ReplicaSet controller.
            deploy = {"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "inflight", "namespace": OP_NS, "labels": OP_LABELS},
                      "spec": {"replicas": 1, "selector": {"matchLabels": OP_LABELS}, "template": {
                          "metadata": {"labels": OP_LABELS},
                          "spec": {"containers": [{"name": "operator", "image": "x"}]}}}}
            await cluster.create(f"/apis/apps/v1/namespaces/{OP_NS}/deployments", deploy)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "inflight-0", "namespace": OP_NS,
                                                                  "labels": OP_LABELS},
                   "spec": {"containers": [{"name": "operator", "image": "x"}]}}
            await cluster.create(f"/api/v1/namespaces/{OP_NS}/pods", pod)

            async def replica_set_controller() -> None:
                while (await cluster.child("deployments", "inflight", OP_NS))["spec"]["replicas"] != 0:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # the pod takes a moment to go: the hook must wait for it
                await cluster.request("DELETE", f"/api/v1/namespaces/{OP_NS}/pods/inflight-0")

            controller = asyncio.create_task(replica_set_controller())
            args = argparse.Namespace(operator_namespace=OP_NS, operator_deployment="inflight",
                                      operator_selector=",".join(f"{k}={v}" for k, v in OP_LABELS.items()),
                                      watch_namespace="")
            released = await uninstall.run(kopf.ConnectionInfo(server=cluster.api_url, insecure=True), args)
            assert controller.done(), "the hook went on before the operator's pods were gone"
            assert released == [f"default/{NAME}"]
            cr = await cluster.cr(NAME)
            assert uninstall.FINALIZER not in (cr["metadata"].get("finalizers") or [])

            await cluster.request("DELETE", CR)

            async def all_gone() -> bool:
                return await cluster.cr(NAME) is None and await cluster.child("deployments", NAME) is None

            await wait_for(all_gone, what="the resource deleted and its children collected")
            kube = KubeClient(kopf.ConnectionInfo(server=cluster.api_url, insecure=True))
            try:
                assert await uninstall.release_finalizers(kube, None) == []  # nothing left to release
            finally:
                await kube.close()
            assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)

    asyncio.run(asyncio.wait_for(scenario(), 60))
