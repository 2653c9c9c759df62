"""``inflight serve --api-server-count 2``: two front-end processes on one port and one engine core
(the simulated device, a zero-time profile). Many streams over fresh connections each get their
tokens exactly once and in order, and both front ends serve some; /metrics on either front end
counts the whole server's requests; both run on uvloop (``--event-loop auto``), and each process settles its garbage collector
once ready; an admin retune through one shows on the other; SIGTERM
drains both and exits 0. Killing the engine core mid-burst answers every stream on both and the
server exits 1; a front end that dies takes the server down. No test knows how fast anything is:
every wait is for an event, bounded only by patience."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inflight.runtime.cli.command import main
from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.server.app import FRONT_END_HEADER
from tests.server.server_helpers import MODEL_NAME, ServeProcess, http, parse_metrics, stream_error_code, wait_until

ADMIN_KEY = "admin-key-asc"
SUCCESS = 'inflight:request_success_total{finished_reason="length",model_name="demo"}'
PATIENCE_S = 60.0


@pytest.fixture(scope="module")
def sim_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    profile = tmp_path_factory.mktemp("sim") / "zero.json"
    profile.write_text(json.dumps({"base_ms": 0.001, "decode_row_ms": 0, "prefill_token_ms": 0,
                                   "attention_ms_per_1k_context": 0}))
    return profile


def _serve(model: Path, profile: Path, *extra: str, env: dict[str, str] | None = None) -> ServeProcess:
    return ServeProcess(["--model", str(model), "--served-model-name", MODEL_NAME, "--port", "0", "--device", "sim",
                         "--sim-profile", str(profile), "--max-num-sequences", "8", "--num-kv-blocks", "256",
                         "--max-model-len", "512", "--api-server-count", "2", *extra], env=env)  # fmt: skip


def _pid(server: ServeProcess, pattern: str) -> int:
    match = re.search(pattern, server.log())
    assert match, server.log()
    return int(match.group(1))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def metrics_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tmpdir")


@pytest.fixture(scope="module")
def two(demo_model_dir: Path, sim_profile: Path, metrics_tmp: Path) -> Iterator[ServeProcess]:
    server = _serve(demo_model_dir, sim_profile, "--admin-api-key", ADMIN_KEY, env={"TMPDIR": str(metrics_tmp)})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _fresh() -> aiohttp.ClientSession:
    """A session that opens a new connection for every request (the kernel picks the front end)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=PATIENCE_S))


def _body(i: int, stream: bool) -> dict:
    return {"model": MODEL_NAME, "prompt": f"# task {i}\ndef f{i}(x):", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": stream}


async def _streamed(session: aiohttp.ClientSession, url: str, i: int,
                    started: asyncio.Event | None = None) -> tuple[str | None, str, str | None]:
    """(the front end that answered, the text, the finish reason) of one stream; ``started`` is
    set at its first chunk."""
    text, reason, done = [], None, False
    async with session.post(f"{url}/v1/completions", json=_body(i, True)) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: {"):
                if started is not None:
                    started.set()
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                reason = choice.get("finish_reason") or reason
    assert done
    return resp.headers.get(FRONT_END_HEADER), "".join(text), reason


async def _whole(session: aiohttp.ClientSession, url: str, i: int) -> str:
    async with session.post(f"{url}/v1/completions", json=_body(i, False)) as resp:
        return (await resp.json())["choices"][0]["text"]


def _from_each_front_end(url: str, path: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """``GET path`` over fresh connections until both front ends have answered: body by front end."""
    bodies: dict[str, str] = {}
    for _ in range(400):  # each try is a coin toss between the two: patience, not timing
        reply = http("GET", url + path, headers=headers)
        assert reply.status == 200, reply.text
        bodies.setdefault(reply.headers[FRONT_END_HEADER], reply.text)
        if len(bodies) == 2:
            return bodies
    raise AssertionError(f"only front end(s) {sorted(bodies)} answered {path}")


def test_many_streams_over_fresh_connections_each_get_every_token_once_in_order(two: ServeProcess) -> None:
    num = 48  # 6x max_num_sequences: requests wait and board on both front ends

    async def burst() -> tuple[list[tuple[str | None, str, str | None]], list[str]]:
        async with _fresh() as session:
            streams = await asyncio.gather(*[_streamed(session, two.url, i) for i in range(num)])
            whole = await asyncio.gather(*[_whole(session, two.url, i) for i in range(num)])
        return list(streams), list(whole)

    streams, whole = asyncio.run(burst())
    assert [reason for _, _, reason in streams] == ["length"] * num
    assert [text for _, text, _ in streams] == whole  # every token once, in order, greedy: the prompt decides
    assert {front_end for front_end, _, _ in streams} == {"0", "1"}, "one front end served every stream"
    assert two.log().count("event loop: uvloop") == 2, two.log()  # the default, on the spawned front end too
    assert two.log().count("garbage collector settled for serving") == 3, two.log()  # the core and each front end


def test_metrics_on_either_front_end_count_the_whole_server(two: ServeProcess) -> None:
    before = parse_metrics(http("GET", f"{two.url}/metrics").text).get(SUCCESS, 0.0)
    num = 16

    async def requests() -> set[str | None]:
        async with _fresh() as session:
            return {fe for fe, _, _ in await asyncio.gather(*[_streamed(session, two.url, i) for i in range(num)])}

    assert asyncio.run(requests()) == {"0", "1"}
    for front_end, text in _from_each_front_end(two.url, "/metrics").items():
        figures = parse_metrics(text)
        assert figures[SUCCESS] == before + num, (front_end, figures[SUCCESS])

    def none_running() -> bool:  # the core's last stats reach each front end on its own pipe, maybe after a stream's end
        return all(parse_metrics(text)["inflight:num_requests_running"] == 0
                   for text in _from_each_front_end(two.url, "/metrics").values())  # fmt: skip

    assert wait_until(none_running, PATIENCE_S)


def test_an_admin_retune_through_one_front_end_shows_on_the_other(two: ServeProcess) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    current = json.loads(http("GET", f"{two.url}/admin/config", headers=admin).text)["max_num_sequences"]
    wanted = 3 if current != 3 else 5
    reply = http("POST", f"{two.url}/admin/config", {"max_num_sequences": wanted}, headers=admin)
    assert reply.status == 200, reply.text
    for front_end, text in _from_each_front_end(two.url, "/admin/config", admin).items():
        assert json.loads(text)["max_num_sequences"] == wanted, front_end
    for front_end, text in _from_each_front_end(two.url, "/metrics").items():
        assert parse_metrics(text)["inflight:max_num_sequences"] == wanted, front_end


def test_sigterm_drains_both_front_ends_and_exits_zero(two: ServeProcess, metrics_tmp: Path) -> None:
    front_end = _pid(two, r"front end 1 \(pid (\d+)\) listening")
    core = _pid(two, r"engine core \(pid (\d+)\)")
    assert list(metrics_tmp.glob("inflight-metrics-*")), "the shared metrics directory is missing"
    two.terminate()
    assert two.proc.wait(PATIENCE_S) == 0, two.log()
    assert not _alive(front_end) and not _alive(core)
    assert not list(metrics_tmp.glob("inflight-metrics-*")), "the shared metrics directory was left behind"
    assert two.log().count("drain complete") == 2, two.log()


async def _outcome(session: aiohttp.ClientSession, url: str, i: int) -> str:
    """How one long stream ended: "error:<code>", "status:<status>:<code>" or "completed"."""
    body = {**_body(i, True), "max_tokens": 400}
    code = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"status:{resp.status}:{(await resp.json()).get('error', {}).get('code')}"
        async for raw in resp.content:
            code = stream_error_code(raw) or code
    return "completed" if code is None else f"error:{code}"


def test_killing_the_engine_core_mid_burst_answers_every_stream_and_exits_non_zero(
        demo_model_dir: Path, sim_profile: Path) -> None:
    # The core stalls at step 31 (injected; the watchdog waits its default 300 s): the burst is
    # in flight on both front ends when the core is killed.
    server = _serve(demo_model_dir, sim_profile, env={FAULT_ENV: "stall-after-steps:30"})
    try:
        server.wait_ready()
        core = _pid(server, r"engine core \(pid (\d+)\)")
        front_end = _pid(server, r"front end 1 \(pid (\d+)\) listening")

        async def scenario() -> list[str]:
            async with _fresh() as session:
                streams = [asyncio.create_task(_outcome(session, server.url, i)) for i in range(24)]
                while "stalling the engine thread" not in server.log():
                    await asyncio.sleep(0.02)
                os.kill(core, signal.SIGKILL)
                return list(await asyncio.gather(*streams))

        outcomes = asyncio.run(asyncio.wait_for(scenario(), PATIENCE_S))
        code = server.proc.wait(PATIENCE_S)
        assert wait_until(lambda: not _alive(front_end), 10), "front end 1 outlived the server"
    finally:
        server.stop()
    assert all(o in ("error:engine_dead", "status:503:engine_dead") for o in outcomes), outcomes
    assert code == 1, server.log()
    assert server.log().count("CRITICAL inflight.server.engine: engine dead") == 2, server.log()


def test_a_front_end_that_dies_takes_the_server_down(demo_model_dir: Path, sim_profile: Path) -> None:
    server = _serve(demo_model_dir, sim_profile)
    try:
        server.wait_ready()
        core = _pid(server, r"engine core \(pid (\d+)\)")
        front_end = _pid(server, r"front end 1 \(pid (\d+)\) listening")
        os.kill(front_end, signal.SIGKILL)
        code = server.proc.wait(PATIENCE_S)
        assert wait_until(lambda: not _alive(core), 10), "the engine core outlived the server"
    finally:
        server.stop()
    assert code == 1, server.log()
    assert f"front end 1 (pid {front_end}) exited with code -9; taking the server down" in server.log()


def test_single_process_with_several_front_ends_is_refused(demo_model_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(demo_model_dir), "--single-process", "--api-server-count", "2"])
    assert exit_.value.code == 2
    assert "--api-server-count 2 needs the engine-core process" in capsys.readouterr().err


def test_sigterm_lets_streams_in_flight_on_both_front_ends_finish(demo_model_dir: Path, sim_profile: Path) -> None:
    # Every step sleeps 40 ms (injected) so that the streams are still running at the SIGTERM.
    server = _serve(demo_model_dir, sim_profile, env={FAULT_ENV: "slow-steps:40"})
    num = 8  # max_num_sequences: every one runs at once
    try:
        server.wait_ready()

        async def scenario() -> list[tuple[str | None, str, str | None]]:
            started = [asyncio.Event() for _ in range(num)]
            async with _fresh() as session:
                streams = [asyncio.create_task(_streamed(session, server.url, i, started[i])) for i in range(num)]
                await asyncio.gather(*[event.wait() for event in started])  # every one has its first token
                server.terminate()
                return list(await asyncio.gather(*streams))

        results = asyncio.run(asyncio.wait_for(scenario(), PATIENCE_S))
        code = server.proc.wait(PATIENCE_S)
    finally:
        server.stop()
    assert [reason for _, _, reason in results] == ["length"] * num, server.log()
    assert code == 0, server.log()
    assert server.log().count("drain complete") == 2, server.log()
