"""``python -m inflight.runtime`` is the ``inflight`` command (``serve`` and friends).

Owns nothing but the hand-off to ``inflight.runtime.cli.command.main``.
"""

import sys

from inflight.runtime.cli.command import main

sys.exit(main())
