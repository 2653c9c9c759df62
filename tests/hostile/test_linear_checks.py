"""Checks on client text are linear (issue 46, finding 1).

The JSON depth check used to strip strings with ``"(?:[^"\\\\]|\\\\.)*"`` in one ``re.sub``:
``"`` plus 64k copies of ``\\"`` (an unterminated string full of escaped quotes) made the regex
engine run to the end of the text from every quote, 47 s for a 256 KB body in one C call holding
the GIL, and ``/health`` and every stream froze with it. Here the work is *counted*, never timed:
the scanner's steps for adversarial strings of 16 KiB to 4 MiB grow exactly as the text, and its
pattern has no repetition, so the regex engine's work at any one position is a constant. Then a
live server gets the largest such body (near its 4 MiB limit) in a field that reaches the check
while ``/health`` is asked: ``/health`` answers while the check is in progress, and the big
request gets its 400.
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.runtime import json_text
from inflight.runtime.server.openai import tool_stream
from tests.hostile.suite import API_KEY, MODEL
from tests.server.server_helpers import LiveServer, Reply, ServeProcess, http

KIB = 1024
SIZES = (16 * KIB, 64 * KIB, 256 * KIB, KIB * KIB, 4 * KIB * KIB)
# (name, the text of about n characters)
SHAPES: tuple[tuple[str, Callable[[int], str]], ...] = (
    ("quote and escaped quotes", lambda n: '"' + '\\"' * (n // 2)),  # the 47-second body
    ("opening brackets", lambda n: "[" * n),
    ("quotes", lambda n: '"' * n),
    ("backslashes", lambda n: "\\" * n),
    ("unterminated string of brackets", lambda n: '"' + "[{" * (n // 2)),
    ("escaped quotes then brackets", lambda n: '"' + '\\"' * (n // 4) + "[" * (n // 2)),
    ("objects opened with string keys", lambda n: '{"a":' * (n // 5)),
    ("escapes, quotes and brackets", lambda n: '[\\"{"]\\\\' * (n // 8)),
    ("plain text", lambda n: "a" * n),
)


def _assert_linear(work: list[int], lengths: list[int]) -> None:
    """Work at most one step per character, and 4x the text is 4x the work (±1%)."""
    for steps, length in zip(work, lengths, strict=True):
        assert steps <= length, (steps, length)
    for small, big in zip(work[:-1], work[1:], strict=True):
        assert (small == 0 and big == 0) or 3.96 <= big / small <= 4.04, work


@pytest.mark.parametrize(("name", "shape"), SHAPES, ids=[s[0] for s in SHAPES])
def test_the_depth_scan_work_grows_linearly_from_16_kib_to_4_mib(name: str, shape: Callable[[int], str]) -> None:
    texts = [shape(size) for size in SIZES]
    _assert_linear([json_text.depth_scan(t).num_steps for t in texts], [len(t) for t in texts])


@settings(max_examples=12, deadline=None)
@given(st.text(alphabet='"\\[]{}a :,', min_size=1, max_size=12))
def test_any_repeated_unit_scans_in_linear_work(unit: str) -> None:
    texts = [unit * (size // len(unit)) for size in SIZES[:4]]
    _assert_linear([json_text.depth_scan(t).num_steps for t in texts], [len(t) for t in texts])


def test_the_scanning_patterns_cost_a_constant_per_position() -> None:
    """A pattern of bounded width cannot backtrack more than that width, so a scan that moves
    forward from match to match costs the regex engine a constant per character. The pattern the
    scan replaced had unbounded width: that is what made it quadratic."""
    parser = getattr(re, "_parser", None) or importlib.import_module("sre_parse")
    patterns = [json_text.TOKEN, tool_stream._OUTSIDE, tool_stream._INSIDE, tool_stream._NONSPACE,
                tool_stream._NONSPACE_JSON]
    for pattern in patterns:
        assert parser.parse(pattern.pattern, pattern.flags).getwidth()[1] <= 2, pattern.pattern


def _reference_depth(text: str) -> int:
    """Character by character, as ``json.loads`` reads strings."""
    depth = deepest = 0
    in_string = escape = False
    for char in text:
        if escape:
            escape = False
        elif in_string:
            in_string, escape = char != '"', char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}" and depth:
            depth -= 1
    return deepest


JSON_VALUES = st.recursive(st.none() | st.integers() | st.text(alphabet='ab"\\[]{}'),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                               st.text(alphabet='k"\\[{', max_size=3), inner, max_size=3),
                           max_leaves=30)  # fmt: skip


def _value_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_value_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_value_depth, value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_the_depth_of_json_text_is_the_depth_of_its_value(value: Any) -> None:
    text = json.dumps(value)
    assert json_text.nesting_depth(text) == _value_depth(value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='"\\[]{}a', max_size=60), st.integers(min_value=0, max_value=6))
def test_the_scan_reads_strings_as_json_does_and_stops_past_the_limit(text: str, limit: int) -> None:
    depth = json_text.depth_scan(text).depth
    assert depth == _reference_depth(text)
    assert (json_text.depth_scan(text, limit).depth > limit) == (depth > limit) == json_text.too_deep(text, limit)


# ---- served: /health answers while the largest adversarial body is checked -----------------

MAX_BODY_BYTES = 4 * KIB * KIB  # the server's default --max-body-bytes
HANG_S = 120.0  # a bound on a hang, never a measure of speed
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _adversarial_text() -> str:
    """The 47-second shape at the body limit: each ``\\"`` is 4 bytes once JSON-encoded; more
    opening brackets than the depth limit, so the text is scanned rather than let through."""
    return '"' + '\\"' * ((MAX_BODY_BYTES - 8 * KIB) // 4) + "[" * 100


def _history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


BIG_REQUESTS = {
    "guided_json": ("/v1/completions", "guided_json",
                    lambda s: {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_json": s}),
    "tokenize history arguments": ("/tokenize", "messages", lambda s: {"model": MODEL, "messages": _history(s)}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("linear-model") / "demo", size="tiny")


@pytest.fixture(scope="module")
def big_body_server(model_dir: Path) -> Iterator[LiveServer]:
    """The two-process server in this process (its front end can be instrumented), with the
    default 4 MiB body limit and an inference key."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.server import ServerSettings

    settings = ServerSettings(model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    config = EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256)
    live = LiveServer(model_dir, config, settings, engine_process=True).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def served_process(model_dir: Path) -> Iterator[ServeProcess]:
    """``inflight serve`` as users run it, in its own process: a front end frozen by a check
    shows up here as an unanswered ``/health``, not as a frozen test runner."""
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--port", "0",
                           "--api-key", API_KEY, "--max-num-sequences", "4", "--num-kv-blocks", "64",
                           "--max-model-len", "256"])  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _big_body(case: str) -> tuple[str, str, bytes]:
    path, param, make = BIG_REQUESTS[case]
    body = json.dumps(make(_adversarial_text())).encode()
    assert MAX_BODY_BYTES - 16 * KIB < len(body) <= MAX_BODY_BYTES
    return path, param, body


def _assert_refused(reply: Reply, param: str) -> None:
    assert reply.status == 400, reply.text[:300]
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("case", list(BIG_REQUESTS))
def test_health_never_misses_while_the_real_check_runs(served_process: ServeProcess, case: str) -> None:
    """The real check, in a real server: every ``/health`` asked while the big request is in
    flight is answered 200 (the old check froze the whole front end for hours at this size)."""
    path, param, body = _big_body(case)
    done = threading.Event()
    answers: list[int] = []

    def poll() -> None:
        while not done.is_set():
            answers.append(http("GET", served_process.url + "/health", timeout=HANG_S).status)

    with ThreadPoolExecutor(1) as pool:
        poller = pool.submit(poll)
        try:
            reply = http("POST", served_process.url + path, body, HEADERS, HANG_S * 2)
        finally:
            done.set()
        poller.result()
    assert answers and set(answers) == {200}
    _assert_refused(reply, param)


@pytest.mark.parametrize("case", list(BIG_REQUESTS))
def test_health_answers_while_the_largest_body_is_checked(big_body_server: LiveServer, case: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is held at its start until a ``/health`` answer has come back: a check on the
    event loop would keep ``/health`` from answering, and the hold would run out unanswered."""
    path, param, body = _big_body(case)
    started, health_answered = threading.Event(), threading.Event()
    held: list[bool] = []
    scan = json_text.depth_scan

    def held_scan(text: str, stop_above: int | None = None) -> json_text.DepthScan:
        if len(text) > MAX_BODY_BYTES // 4:  # the big request's text, not another one's
            started.set()
            held.append(health_answered.wait(HANG_S))
        return scan(text, stop_above)

    monkeypatch.setattr(json_text, "depth_scan", held_scan)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(http, "POST", big_body_server.url + path, body, HEADERS, HANG_S * 2)
        assert started.wait(HANG_S), "the big request never reached the depth check"
        health = http("GET", big_body_server.url + "/health", timeout=HANG_S)
        health_answered.set()
        reply = big.result()
    assert health.status == 200
    assert held and all(held)  # /health answered while the check was in progress
    _assert_refused(reply, param)
