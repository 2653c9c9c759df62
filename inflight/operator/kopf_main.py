"""The module ``kopf run`` loads (``kopf run -m inflight.operator.kopf_main``, what the chart,
the operator image and ``python -m inflight.operator`` run; ``kopf run -m inflight.operator``
imports it too): importing it checks the installation's spec defaults (the chart's image env
vars: a bad value stops the operator here, not every resource later) and registers the
handlers onto kopf's default registry. Nothing else imports it.
"""

import kopf

from inflight.operator.handlers import register
from inflight.operator.spec import SpecDefaults

SpecDefaults.from_env()  # raises ValueError naming the variable
register(kopf.get_default_registry())
