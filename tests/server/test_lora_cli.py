"""``inflight serve`` with LoRA flags (issue 49): usage errors before anything loads (``--lora-modules``
without ``--enable-lora``, LoRA with the pooling runner), and a real server process whose
``--lora-modules`` either all load before it says ready (served under their names) or fail the
start with the adapter's reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.runtime.cli.command import main
from inflight.runtime.server.app import FRONT_END_HEADER
from tests.server.lora_adapters import make_adapter
from tests.server.server_helpers import MODEL_NAME, ServeProcess, http, wait_until


@pytest.mark.parametrize(("argv", "said"), [
    (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--runner", "pooling"], "enable_lora needs the generate runner"),
    (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "--lora-modules names 'a' twice"),
    (["--enable-lora", "--lora-modules", '{"path": "/p"}'], "non-empty"),
])
def test_lora_usage_errors(demo_model_dir: Path, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(demo_model_dir), *argv])
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err


def _models_by_front_end(url: str) -> dict[str, list[str]]:
    """The ids ``GET /v1/models`` lists, by the front end that answered, once both have answered."""
    seen: dict[str, list[str]] = {}
    for _ in range(400):  # each try is a coin toss between the two front ends: patience, not timing
        reply = http("GET", f"{url}/v1/models")
        seen[reply.headers[FRONT_END_HEADER]] = [c["id"] for c in json.loads(reply.text)["data"]]
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only front end(s) {sorted(seen)} answered")


def test_serve_loads_lora_modules_before_ready_and_every_front_end_knows(demo_model_dir: Path, tmp_path: Path) -> None:
    """Two front ends on one engine core: both list the modules front end 0 loaded at start, and
    an adapter loaded or unloaded through either shows on both."""
    good = make_adapter(demo_model_dir, tmp_path / "good", seed=1)
    serve = ServeProcess([str(demo_model_dir), "--served-model-name", MODEL_NAME, "--port", "0", "--enable-lora",
                          "--max-lora-rank", "8", "--num-kv-blocks", "64", "--api-server-count", "2",
                          "--admin-api-key", "admin", "--lora-modules", f"good={good}",
                          json.dumps({"name": "json-form", "path": str(good), "base_model_name": "org/base"})])
    admin = {"Authorization": "Bearer admin"}
    try:
        serve.wait_ready()
        assert _models_by_front_end(serve.url) == {"0": [MODEL_NAME, "good", "json-form"],
                                                   "1": [MODEL_NAME, "good", "json-form"]}
        cards = {c["id"]: c for c in json.loads(http("GET", f"{serve.url}/v1/models").text)["data"]}
        assert cards["good"]["parent"] == MODEL_NAME and cards["json-form"]["parent"] == "org/base"
        reply = http("POST", f"{serve.url}/v1/completions", {"model": "json-form", "prompt": "hi", "max_tokens": 2})
        assert reply.status == 200 and json.loads(reply.text)["model"] == "json-form"
        load = {"lora_name": "live", "lora_path": str(good)}
        assert http("POST", f"{serve.url}/v1/load_lora_adapter", load, headers=admin).status == 200
        assert wait_until(lambda: all("live" in ids for ids in _models_by_front_end(serve.url).values()), 30)
        unload = {"lora_name": "good"}
        assert http("POST", f"{serve.url}/v1/unload_lora_adapter", unload, headers=admin).status == 200
        assert wait_until(lambda: all(ids == [MODEL_NAME, "json-form", "live"]
                                      for ids in _models_by_front_end(serve.url).values()), 30)
    finally:
        serve.stop()


def test_serve_fails_the_start_on_a_refused_lora_module(demo_model_dir: Path, tmp_path: Path) -> None:
    big = make_adapter(demo_model_dir, tmp_path / "big", seed=1, rank=16)
    serve = ServeProcess([str(demo_model_dir), "--port", "0", "--enable-lora", "--max-lora-rank", "8",
                          "--num-kv-blocks", "64", "--lora-modules", f"big={big}"])
    try:
        assert wait_until(lambda: serve.proc.poll() is not None, 180, 0.2), serve.log()
        assert serve.proc.returncode == 1
        assert f"--lora-modules big={big}" in serve.log() and "rank 16 is over max_lora_rank 8" in serve.log()
    finally:
        serve.stop()
