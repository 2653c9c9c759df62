"""A serving process's garbage collector once it is ready (``runtime/engine_core/process_gc.py``): what was
alive is frozen, the young generation's threshold rises above a step's temporaries (never falls),
the older ones are kept, and a reference cycle made afterwards is still collected. Run in a fresh
interpreter: the test process keeps its own collector settings."""

from __future__ import annotations

import json
import subprocess
import sys

from inflight.runtime.engine_core.process_gc import SERVING_GEN0_THRESHOLD

CHILD = """
import gc, json, weakref
from inflight.runtime.engine_core.process_gc import settle_for_serving
gc.set_threshold(700, 7, 9)
started = [object() for _ in range(10)]
settle_for_serving()
frozen, thresholds = gc.get_freeze_count(), gc.get_threshold()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving: only the collector frees it
gone = weakref.ref(a)
del a, b
collected = gc.collect()
gc.set_threshold(50_000, 7, 9)
settle_for_serving()
print(json.dumps({"frozen": frozen, "thresholds": thresholds, "cycle_freed": gone() is None,
                  "collected": collected, "kept_higher": gc.get_threshold()[0]}))
"""


def test_settling_freezes_start_up_raises_the_young_threshold_and_still_frees_cycles() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["frozen"] > 1000  # the interpreter's and the imports' objects, out of every later pass
    assert facts["thresholds"] == [SERVING_GEN0_THRESHOLD, 7, 9]
    assert facts["cycle_freed"] and facts["collected"] >= 2
    assert facts["kept_higher"] == 50_000  # a process that already asked for more keeps it
