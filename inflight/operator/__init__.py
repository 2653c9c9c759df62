"""The kopf operator that turns InferenceDeployment resources into runtime pods.

Importing this package (or any module in it) has no side effects: the handlers are registered
onto kopf's default registry only by ``inflight.operator.kopf_main``, the module ``kopf run
-m inflight.operator.kopf_main`` (and ``python -m inflight.operator``) loads. Tests build their
own registry with ``inflight.operator.handlers.register``.

kopf and the Kubernetes client are the ``operator`` extra, not serving dependencies: the
runtime image has neither, yet runs ``python -m inflight.operator.model_fetch`` (the model
download init container), which imports this package.
"""
