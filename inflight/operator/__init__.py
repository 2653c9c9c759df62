"""The kopf operator that turns InferenceDeployment resources into runtime pods.

Importing this package registers the handlers onto kopf's default registry, which is
what ``kopf run -m inflight.operator`` (and ``python -m inflight.operator``) needs. Tests
build their own registry with ``inflight.operator.handlers.register``.

kopf and the Kubernetes client are the ``operator`` extra, not serving dependencies: the
runtime image has neither, yet runs ``python -m inflight.operator.model_fetch`` (the model
download init container), which imports this package. Without kopf there is nothing to
register (and nothing could run the handlers), so the import registers nothing.
"""

try:
    import kopf
except ModuleNotFoundError:  # a serving install: only the kopf-free modules are usable
    kopf = None

if kopf is not None:
    from inflight.operator.handlers import register

    register(kopf.get_default_registry())
