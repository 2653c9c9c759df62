"""The load client: an asyncio streaming OpenAI ``/v1/completions`` client that times each request.

Owns sending one workload (a list of :class:`RequestSpec` with arrival offsets) to one server
and recording, per request, the time to first token, every inter-token (inter-chunk) gap,
the end-to-end latency and the token counts the server reports in its ``usage``. Every
request has a timeout and the whole run a deadline, so a stuck server cannot hang a
benchmark. Knows nothing about which server it talks to or how results are summarized.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload: sent ``arrival_s`` seconds after the run starts."""

    prompt: str
    max_tokens: int
    arrival_s: float = 0.0
    user: str | None = None  # OpenAI's end-user id (the fair scheduler's tenant)
    ignore_eos: bool = False  # exactly max_tokens (vLLM's and inflight's extension; sent only when set)


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times in seconds, relative to its own send time."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token chunks
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.error or self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True)
class RunResult:
    results: tuple[RequestResult, ...]
    wall_s: float  # first send to last response


def completion_body(model: str, spec: RequestSpec) -> dict[str, object]:
    """The request body: only standard OpenAI fields (peers reject unknown ones), and
    ``ignore_eos`` where the spec asks for it."""
    body: dict[str, object] = {
        "model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if spec.user is not None:
        body["user"] = spec.user
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _read_stream(resp: aiohttp.ClientResponse, sent: float, result: RequestResult) -> None:
    """Read an SSE stream a network read at a time (not a line at a time: the client shares the
    machine with the server it measures, so its own work per event is kept small); every event
    of one read is stamped with that read's time."""
    last: float | None = None
    pending = b""
    async for data in resp.content.iter_any():
        *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
        now = time.perf_counter()
        for raw in events:
            for line in raw.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                last = _read_event(json.loads(payload), now, sent, last, result)


def _read_event(event: dict, now: float, sent: float, last: float | None, result: RequestResult) -> float | None:
    """Account one event; the time of the last event that carried text."""
    if any(c.get("text") for c in event.get("choices") or ()):
        if result.ttft_s is None:
            result.ttft_s = now - sent
        elif last is not None:
            result.gaps_s.append(now - last)
        last = now
    usage = event.get("usage")
    if usage:
        result.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.num_output_tokens = int(usage.get("completion_tokens") or 0)
    return last


async def send_one(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, timeout_s: float
) -> RequestResult:
    """Stream one completion; errors and timeouts are recorded, never raised."""
    result = RequestResult()
    sent = time.perf_counter()

    async def attempt() -> None:
        async with session.post(f"{url}/v1/completions", json=completion_body(model, spec)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            await _read_stream(resp, sent, result)

    try:
        await asyncio.wait_for(attempt(), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    if result.error:
        return result
    result.e2e_s = time.perf_counter() - sent
    if result.ttft_s is None or result.num_output_tokens == 0:
        result.error = "no tokens or no usage in the stream"
    return result


async def _run(url: str, model: str, specs: list[RequestSpec], timeout_s: float) -> RunResult:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def delayed(spec: RequestSpec) -> RequestResult:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - start)))
            return await send_one(session, url, model, spec, timeout_s)

        results = await asyncio.gather(*(delayed(s) for s in specs))
        return RunResult(tuple(results), time.perf_counter() - start)


def run_workload(url: str, model: str, specs: list[RequestSpec], timeout_s: float = 600.0,
                 loop: str = "auto") -> RunResult:
    """Send ``specs`` to the server at ``url`` (each at its arrival offset) and wait for all.
    ``loop``: the client's event loop, chosen as the server's ``--event-loop`` is (``auto``:
    uvloop where installed). The client shares the machine with the server it measures, so
    its own CPU per token is kept low; ``asyncio`` runs it on the standard library's loop."""
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(_run(url, model, specs, timeout_s))


def _loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's factory (``auto`` where it is installed, or ``uvloop``), else None: asyncio's."""
    if loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"client event loop {loop!r}: auto, uvloop or asyncio")
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def greedy_text(url: str, model: str, spec: RequestSpec, timeout_s: float = 120.0) -> str:
    """One non-streaming greedy completion of ``spec`` (for agreement checks between servers)."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # noqa: S310 - 127.0.0.1 only
        return str(json.load(resp)["choices"][0]["text"])
