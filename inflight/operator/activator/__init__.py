"""The activator: a small HTTP proxy the chart ships for ``autoscaling.minReplicas: 0``.

Clients (or a Gateway route) call ``http://<activator>/<namespace>/<name>/v1/...``; the activator
forwards to the InferenceDeployment's own Service, and while no pod is ready it *holds* the
request (a bounded queue per backend, a bounded wait) instead of dropping it, answering 503 with
``Retry-After`` (OpenAI's error format) past either bound. The operator reports each
scale-to-zero backend here every tick and reads back its demand (requests held and in flight,
seconds idle), which is how it scales 0 -> 1 and, after the idle window with nothing held,
1 -> 0 (:mod:`inflight.operator.scale_to_zero`). ``holding`` owns the per-backend queue, ``app``
the HTTP side, ``__main__`` the command line. It imports no runtime server code and no kopf.
"""
