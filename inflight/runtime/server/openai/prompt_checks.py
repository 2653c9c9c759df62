"""The checks every endpoint makes before it hands prompts to the engine, written once.

Generation (:func:`.generation.plan`) and pooling (``pooling_api.common.run_prompts``) both
refuse a prompt of zero tokens, have the engine validate each (prompt, params) pair before
anything runs, naming the client's own field where the engine names its own (``prompt``,
``max_tokens``), and refuse a request of more engine requests than the engine can ever hold
(``max_num_sequences`` running + ``max_queue_len`` waiting). Knows nothing about what the
prompts are for or how their outputs are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.errors import APIError, bad_request, from_rejection


def check_prompt(engine: Any, ids: Sequence[int], params: SamplingParams, param: str, what: str,
                 engine_names: tuple[str, ...] = ("prompt",)) -> None:
    """400 (or the engine's 429/404) for a prompt the engine can never run: ``ids`` empty, or
    refused by ``engine.validate_request``. ``param``: the client's field holding the prompt;
    ``what``: the prompt as the message names it (``the messages``, ``input 2 of 'input'``);
    ``engine_names``: the engine's field names that mean ``param`` here."""
    if not ids:
        raise bad_request(f"{what} encodes to zero tokens; send some text", param)
    try:
        engine.validate_request(list(ids), params)
    except RequestRejectedError as exc:
        raise rejection(exc, param, engine_names) from None


def rejection(exc: RequestRejectedError, param: str, engine_names: tuple[str, ...] = ("prompt",)) -> APIError:
    """The HTTP error for an engine rejection, naming ``param`` where the engine names one of
    ``engine_names`` (or nothing)."""
    error = from_rejection(exc, param)
    if error.param in engine_names:
        error.param = param
    return error


def check_fits_queue(num_requests: int, config: EngineConfig, param: str, made_of: str, advice: str,
                     code: str) -> None:
    """400 ``code`` for more engine requests than the engine can ever hold at once.
    ``made_of``: what the count is (``prompts x n``, ``inputs``); ``advice``: what to send."""
    capacity = config.max_num_sequences + config.max_queue_len
    if num_requests > capacity:
        raise bad_request(
            f"this request makes {num_requests} engine requests ({made_of}) but the server holds at "
            f"most {capacity} at once ({config.max_num_sequences} running + {config.max_queue_len} waiting); "
            f"{advice}", param, code=code)

