"""``python -m inflight.bench``: see :mod:`inflight.bench.cli`."""

import sys

from inflight.bench.cli import main

sys.exit(main())
