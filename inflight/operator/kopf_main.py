"""The module ``kopf run`` loads (``kopf run -m inflight.operator.kopf_main``, what the chart,
the operator image and ``python -m inflight.operator`` run): importing it registers the
handlers onto kopf's default registry. Nothing else imports it.
"""

import kopf

from inflight.operator.handlers import register

register(kopf.get_default_registry())
