"""The garbage collector of a serving process, once it has loaded what it serves.

A serving process (the engine core, each front end) builds most of its objects while it
starts: torch, transformers, the model, the tokenizer, aiohttp. After that its work is steps
and streamed tokens, which allocate many short-lived objects (outputs, chunks, tuples, SSE
bytes) and few that live long. CPython's defaults fit neither half:

- a full collection scans every object that start-up made: ~70 ms in a front end with
  transformers loaded, a pause for every stream it serves, and more in the core;
- the young generation is collected every 700 net allocations, so a step that holds a few
  thousand temporaries at once triggers collections mid-step that scan objects about to die
  anyway. Measured on the simulated device (256 streams, ``bench.studies.host_path``), the
  collector took ~7-12% of the core's CPU and ~10% of a front end's.

:func:`settle_for_serving` collects once, freezes what is alive (``gc.freeze()``: no pass scans
it again; what dies later is still freed by reference counting) and raises the young
generation's threshold above a step's temporaries, so collections are rare and scan little.
Cycles still get collected; they wait for more allocations first. Called once, when the
process is ready, never from a library call (a test process that runs a server in-process
keeps its own collector settings). Knows nothing about serving itself.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("inflight.process")

# Above the temporaries of one busy step (a few per row and token, thousands at 512 rows),
# small enough that the young generation's pass stays short (a few ms at most).
SERVING_GEN0_THRESHOLD = 20_000


def settle_for_serving() -> None:
    """Collect, freeze what start-up left alive, and raise the young generation's threshold
    to :data:`SERVING_GEN0_THRESHOLD` (never lower it); the older generations' are kept."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, SERVING_GEN0_THRESHOLD), gen1, gen2)
    logger.info("garbage collector settled for serving: %d objects frozen, thresholds %s", gc.get_freeze_count(),
                gc.get_threshold())
