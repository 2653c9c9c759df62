"""vLLM's example Grafana dashboard finds every series it queries on inflight's /metrics (issue 50).

The names come from a checked-in list (``data/vllm_dashboard_metrics.txt``, read from the
dashboard's expressions: its source and version are in the file); inflight serves each with
``inflight:`` for ``vllm:``. One request on a fresh server, then every series exists with the
values that request implies; ``n`` > 1 shows the per-prompt figures; the standard
``process_*`` / ``python_*`` collectors are there, one front end or several.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inflight.runtime.config import EngineConfig
from inflight.runtime.outputs import RequestOutput, RequestTimes
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.process_metrics import MARKER_PREFIX, FrontEndProcessCollector
from inflight.runtime.server.request_metrics import RequestHistograms, request_tokens_buckets
from tests.server.server_helpers import MODEL_NAME, LiveServer, ServeProcess, http

DATA = Path(__file__).parent / "data" / "vllm_dashboard_metrics.txt"
MAX_MODEL_LEN = 256
SEL = f'model_name="{MODEL_NAME}"'


def dashboard_names() -> list[str]:
    names = [line.split()[0] for line in DATA.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert names and all(n.startswith("vllm:") for n in names), names
    return names


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a scrape, by its series name (``_bucket``, ``_sum``... included)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def value(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    (hit,) = [v for lab, v in found[name] if all(lab.get(k) == w for k, w in labels.items())]
    return hit


@pytest.fixture(scope="module")
def fresh(demo_model_dir: Path) -> Iterator[LiveServer]:
    """A server of its own: its histograms hold only what these tests send."""
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN),
                      ServerSettings(model_name=MODEL_NAME)).start()
    yield live
    live.stop()


def _scrape(server: LiveServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    return samples(http("GET", f"{server.url}/metrics").text)


def test_every_dashboard_series_exists_after_one_request(fresh: LiveServer) -> None:
    reply = http("POST", f"{fresh.url}/v1/completions",
                 {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 7, "temperature": 0,
                  "ignore_eos": True})
    assert reply.status == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == 7
    found = _scrape(fresh)
    for name in dashboard_names():
        ours = "inflight:" + name.removeprefix("vllm:")
        assert ours in found, f"{name} (as {ours}) is not in /metrics"
        assert any(lab.get("model_name") == MODEL_NAME for lab, _ in found[ours]), ours

    # The heatmaps: one request, its prompt and its output, in vLLM's 1-2-5 buckets up to max_model_len.
    prompt_len = usage["prompt_tokens"]
    assert value(found, "inflight:request_prompt_tokens_count", model_name=MODEL_NAME) == 1
    assert value(found, "inflight:request_prompt_tokens_sum", model_name=MODEL_NAME) == prompt_len
    assert value(found, "inflight:request_generation_tokens_count", model_name=MODEL_NAME) == 1
    assert value(found, "inflight:request_generation_tokens_sum", model_name=MODEL_NAME) == 7
    edges = sorted(float(lab["le"]) for lab, _ in found["inflight:request_prompt_tokens_bucket"]
                   if lab["le"] != "+Inf")
    assert edges == [1, 2, 5, 10, 20, 50, 100, 200]
    for lab, count in found["inflight:request_generation_tokens_bucket"]:
        assert count == (1 if float(lab["le"]) >= 7 else 0), lab
    assert value(found, "inflight:request_max_num_generation_tokens_sum", model_name=MODEL_NAME) == 7
    assert value(found, "inflight:request_params_n_sum", model_name=MODEL_NAME) == 1
    assert value(found, "inflight:request_params_max_tokens_sum", model_name=MODEL_NAME) == 7

    # The times: one request each; the phases add up as vLLM defines them.
    def total(name: str) -> float:
        assert value(found, f"inflight:{name}_count", model_name=MODEL_NAME) == 1, name
        return value(found, f"inflight:{name}_sum", model_name=MODEL_NAME)

    queue, prefill, decode = total("request_queue_time_seconds"), total("request_prefill_time_seconds"), \
        total("request_decode_time_seconds")
    inference, e2e, ttft = total("request_inference_time_seconds"), total("e2e_request_latency_seconds"), \
        total("time_to_first_token_seconds")
    assert min(queue, prefill, decode) >= 0
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference == pytest.approx(e2e, abs=1e-6)
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)
    assert value(found, "inflight:inter_token_latency_seconds_count", model_name=MODEL_NAME) == 6
    assert value(found, "inflight:request_success_total", model_name=MODEL_NAME, finished_reason="length") == 1
    assert value(found, "inflight:prompt_tokens_total", model_name=MODEL_NAME) == prompt_len
    assert value(found, "inflight:generation_tokens_total", model_name=MODEL_NAME) == 7


def test_n_choices_count_once_per_prompt(fresh: LiveServer) -> None:
    before = _scrape(fresh)
    reply = http("POST", f"{fresh.url}/v1/completions",
                 {"model": MODEL_NAME, "prompt": ["x = 1", "y = 2"], "n": 3, "max_tokens": 5,
                  "temperature": 1.0, "seed": 3, "ignore_eos": True})
    assert reply.status == 200, reply.text
    after = _scrape(fresh)

    def grew(name: str) -> float:
        return value(after, name, model_name=MODEL_NAME) - value(before, name, model_name=MODEL_NAME)

    assert grew("inflight:request_generation_tokens_count") == 6  # one per choice
    assert grew("inflight:request_generation_tokens_sum") == 30
    assert grew("inflight:request_max_num_generation_tokens_count") == 2  # one per prompt
    assert grew("inflight:request_max_num_generation_tokens_sum") == 10
    assert grew("inflight:request_params_n_count") == 2 and grew("inflight:request_params_n_sum") == 6


class _Choice:
    def __init__(self, num_output_tokens: int) -> None:
        self.num_output_tokens = num_output_tokens
        self.finish_reason: str | None = None


def test_the_longest_choice_of_a_prompt_is_observed_with_its_last() -> None:
    registry = CollectorRegistry()
    histograms = RequestHistograms("m", registry, lambda: 64)
    choices = [_Choice(3), _Choice(9), _Choice(4)]
    for choice in (choices[1], choices[0], choices[2]):  # the longest is not the last to finish
        choice.finish_reason = "stop"
        out = RequestOutput("r", (), "", True, "stop", 6, choice.num_output_tokens, 2)
        histograms.observe(out, RequestTimes(10.0, 10.5, 11.0, 12.0), 16, choices)
    found = samples(generate_latest(registry).decode())
    assert value(found, "inflight:request_max_num_generation_tokens_count", model_name="m") == 1
    assert value(found, "inflight:request_max_num_generation_tokens_sum", model_name="m") == 9
    assert value(found, "inflight:request_params_n_sum", model_name="m") == 3
    assert value(found, "inflight:request_generation_tokens_sum", model_name="m") == 16
    assert value(found, "inflight:request_prefill_kv_computed_tokens_sum", model_name="m") == 3 * 4
    assert value(found, "inflight:request_prefill_time_seconds_sum", model_name="m") == 3 * 0.5
    assert value(found, "inflight:request_decode_time_seconds_sum", model_name="m") == 3 * 1.0
    assert value(found, "inflight:request_params_max_tokens_sum", model_name="m") == 3 * 16


def test_process_and_python_collectors_on_one_front_end(fresh: LiveServer) -> None:
    found = _scrape(fresh)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds", "python_info", "python_gc_objects_collected_total"):
        assert name in found, name
    assert value(found, "process_resident_memory_bytes") > 0
    assert all("pid" not in lab for lab, _ in found["process_cpu_seconds_total"])  # the scraped process alone


def test_several_front_ends_report_each_process_by_pid(tmp_path: Path) -> None:
    """With --api-server-count, each front end marks the shared directory and any scrape
    reports process_* of all of them, told apart by ``pid`` (a child stands in for front end 1)."""
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        for pid in (os.getpid(), other.pid):
            (tmp_path / f"{MARKER_PREFIX}{pid}").touch()
        (tmp_path / "histogram_123.db").touch()  # prometheus_client's own files are not markers
        registry = CollectorRegistry()
        registry.register(FrontEndProcessCollector(str(tmp_path)))
        found = samples(generate_latest(registry).decode())
        pids = {lab["pid"] for lab, _ in found["process_cpu_seconds_total"]}
        assert pids == {str(os.getpid()), str(other.pid)}
        assert {lab["pid"] for lab, _ in found["process_resident_memory_bytes"]} == pids
    finally:
        other.stdin.close()  # type: ignore[union-attr]
        other.wait(30)
    # A front end that has gone is simply absent (the server exits with it anyway).
    found = samples(generate_latest(registry).decode())
    assert {lab["pid"] for lab, _ in found["process_cpu_seconds_total"]} == {str(os.getpid())}


@pytest.mark.parametrize(("max_model_len", "edges"), [
    (1, (1,)), (4, (1, 2)), (10, (1, 2, 5, 10)), (2048, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)),
])
def test_token_buckets_are_vllms_1_2_5_series(max_model_len: int, edges: tuple[int, ...]) -> None:
    assert request_tokens_buckets(max_model_len) == edges


def test_token_buckets_refuse_a_context_of_nothing() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        request_tokens_buckets(0)


def test_two_front_ends_serve_the_dashboard_and_each_process(demo_model_dir: Path, tmp_path: Path) -> None:
    """``--api-server-count 2`` (multiprocess metrics): any scrape holds every dashboard series,
    summed over the front ends, and ``process_*`` of both front-end processes by ``pid``."""
    profile = tmp_path / "zero.json"
    profile.write_text('{"base_ms": 0.001, "decode_row_ms": 0, "prefill_token_ms": 0, '
                       '"attention_ms_per_1k_context": 0}')
    server = ServeProcess(["--model", str(demo_model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
                           "--device", "sim", "--sim-profile", str(profile), "--max-num-sequences", "4",
                           "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN), "--api-server-count", "2"],
                          env={"TMPDIR": str(tmp_path)})
    try:
        server.wait_ready()
        for _ in range(4):  # new connections: the kernel spreads them over the front ends
            reply = http("POST", f"{server.url}/v1/completions",
                         {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 3, "ignore_eos": True})
            assert reply.status == 200, reply.text
        found = samples(http("GET", f"{server.url}/metrics").text)
        for name in dashboard_names():
            assert "inflight:" + name.removeprefix("vllm:") in found, name
        assert value(found, "inflight:request_generation_tokens_count", model_name=MODEL_NAME) == 4
        assert value(found, "inflight:request_generation_tokens_sum", model_name=MODEL_NAME) == 12
        pids = {lab["pid"] for lab, _ in found["process_cpu_seconds_total"]}
        assert len(pids) == 2 and str(server.proc.pid) in pids, (pids, server.proc.pid)
        assert "python_info" in found and "python_gc_objects_collected_total" not in found
    finally:
        server.stop()
