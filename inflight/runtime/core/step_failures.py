"""The step failure policy the generate and pooling steps share.

A batch whose forward pass raises is retried one request at a time: the requests that fail
alone are failed (their callers get an error), the others go on; a batch in which every
request fails alone is fatal (the device or the model is broken, not a request). An
``EngineFatalError`` is never retried. Knows nothing about what a step computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.outputs import EngineFatalError

logger = logging.getLogger("inflight.engine")
T = TypeVar("T")


def run_batch_or_each(
    chunks: tuple[ScheduledChunk, ...], run: Callable[[tuple[ScheduledChunk, ...]], list[T]], what: str
) -> tuple[tuple[ScheduledChunk, ...], list[ScheduledChunk], list[T]]:
    """``run(chunks)``, or on failure ``run`` of each chunk alone: (the chunks that ran, the
    chunks that failed alone, the results of those that ran, in order). ``what`` names the
    step in the log and the fatal error."""
    try:
        return chunks, [], run(chunks)
    except EngineFatalError:
        raise
    except Exception:
        logger.exception("%s failed; retrying its %d request(s) one by one", what, len(chunks))
    ok: list[ScheduledChunk] = []
    failed: list[ScheduledChunk] = []
    results: list[T] = []
    for chunk in chunks:
        try:
            results.extend(run((chunk,)))
            ok.append(chunk)
        except EngineFatalError:
            raise
        except Exception:
            failed.append(chunk)
    if len(chunks) > 1 and not ok:
        raise EngineFatalError(f"the {what} fails for each of its {len(chunks)} requests alone")
    logger.error("failed request(s) %s; %d other(s) go on", [c.req_id for c in failed], len(ok))
    return tuple(ok), failed, results
