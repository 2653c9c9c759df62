"""The kopf operator that turns InferenceDeployment resources into runtime pods.

Importing this package (or any module in it) has no side effects, with one exception: when
kopf's own loader imports it as the module to run (``kopf run -m inflight.operator``, the
spelling a kopf user types first), it registers the handlers exactly as
``inflight.operator.kopf_main`` does, the module ``kopf run -m inflight.operator.kopf_main``
(and ``python -m inflight.operator``, the chart) load. Without that the operator would start
with no handlers and say nothing. Tests build their own registry with
``inflight.operator.handlers.register``.

kopf and the Kubernetes client are the ``operator`` extra, not serving dependencies: the
runtime image has neither, yet runs ``python -m inflight.operator.model_fetch`` (the model
download init container), which imports this package.
"""

import sys

_KOPF_LOADER = "kopf/_cogs/helpers/loaders.py"  # where ``kopf run -m NAME`` imports NAME


def _imported_by_kopf_run_as_the_operator() -> bool:
    """Whether kopf's ``preload`` is importing this package because ``-m inflight.operator``
    named it (not because it imports ``inflight.operator.kopf_main``, which registers itself)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "preload" and code.co_filename.replace("\\", "/").endswith(_KOPF_LOADER):
            modules = frame.f_locals.get("modules")
            return isinstance(modules, (list, tuple)) and __name__ in modules
        frame = frame.f_back
    return False


if _imported_by_kopf_run_as_the_operator():
    import inflight.operator.kopf_main  # noqa: F401  (registers the handlers on kopf's default registry)
