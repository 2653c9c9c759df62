"""The kopf operator that turns InferenceDeployment resources into runtime pods.

Importing this package registers the handlers onto kopf's default registry, which is
what ``kopf run -m inflight.operator`` (and ``python -m inflight.operator``) needs. Tests
build their own registry with ``inflight.operator.handlers.register``.
"""

import kopf

from inflight.operator.handlers import register

register(kopf.get_default_registry())
