"""LoRA serving pieces without a model (issue 49): ``--lora-modules``'s two spellings, a request's
``model`` resolved to an adapter or a 404, the /v1/models cards, the protocol's LoRA messages
across a pipe's pickling, the engine core's answers (a refused load is an answer, never an
exception in the loop), and the ``vllm:lora_requests_info`` series."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from inflight.runtime.cli.command import build_parser, server_settings_from_args
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine_stats import with_lora_stats
from inflight.runtime.engine_core import lora_calls
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.lora.types import LoRAError, LoRAInfo, UnknownLoRA
from inflight.runtime.outputs import EngineStats
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.lora import LoRAModule, lora_cards, parse_lora_module, resolve_model
from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.server.state import ServerSettings
from tests.server.server_helpers import parse_metrics

INFO = LoRAInfo("sql", "/adapters/sql", 8, 16.0, ("q_proj", "v_proj"), "base")


@pytest.mark.parametrize(("text", "module"), [
    ("sql=/adapters/sql", LoRAModule("sql", "/adapters/sql")),
    ("a=b=c", LoRAModule("a", "b=c")),
    ('{"name": "sql", "path": "/p"}', LoRAModule("sql", "/p")),
    ('{"name": "sql", "path": "/p", "base_model_name": "m"}', LoRAModule("sql", "/p", "m")),
])
def test_lora_modules_both_forms(text: str, module: LoRAModule) -> None:
    assert parse_lora_module(text) == module


@pytest.mark.parametrize(("text", "said"), [
    ("sql", "give name=path"),
    ("=/p", "non-empty"),
    ("sql=", "path is empty"),
    ('{"name": "sql"}', "JSON form"),
    ('{"name": "sql", "path": "/p", "extra": 1}', "JSON form"),
    ('{"name": ', "not valid JSON"),
    ("a,b=/p", "no comma"),
])
def test_bad_lora_modules_say_why(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_lora_module(text)


def test_lora_modules_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--lora-modules", "a=/p/a",
                                      '{"name": "b", "path": "/p/b", "base_model_name": "base"}'])
    args.model = args.model_path  # as main() does
    settings = server_settings_from_args(args)
    assert settings.lora_modules == (LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "base"))


def test_lora_modules_flag_refuses_a_bad_entry(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "m", "--lora-modules", "nameonly"])
    assert exit_info.value.code == 2
    assert "--lora-modules 'nameonly': give name=path or a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize(("modules", "said"), [
    ((LoRAModule("a", "/p"), LoRAModule("a", "/q")), "names 'a' twice"),
    ((LoRAModule("demo", "/p"),), "the served model has that name"),
])
def test_settings_refuse_clashing_module_names(modules: tuple[LoRAModule, ...], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        ServerSettings(model_name="demo", lora_modules=modules)


def test_resolve_model() -> None:
    loras = {"sql": INFO}
    assert resolve_model(None, "demo", loras) is None
    assert resolve_model("demo", "demo", loras) is None
    assert resolve_model("sql", "demo", loras) == "sql"
    with pytest.raises(APIError) as error:
        resolve_model("chat", "demo", loras)
    assert (error.value.status, error.value.code, error.value.param) == (404, "model_not_found", "model")
    assert "'sql'" not in error.value.message and "sql" in error.value.message


def test_lora_cards_name_parent_and_root() -> None:
    cards = lora_cards({"sql": INFO}, "demo", {}, 123, 512)
    assert cards == [{"id": "sql", "object": "model", "created": 123, "owned_by": "inflight",
                      "root": "/adapters/sql", "parent": "demo", "max_model_len": 512}]
    assert lora_cards({"sql": INFO}, "demo", {"sql": "org/base"}, 1, None)[0]["parent"] == "org/base"


@pytest.mark.parametrize("message", [
    p.LoadLoRA(1, "sql", "/p"), p.UnloadLoRA(2, "sql"), p.ListLoRAs(3),
    p.LoRADone(4, (INFO,), INFO), p.LoRADone(5, (), error="rank 64 is over max_lora_rank 16", error_kind="refused"),
    p.LoRAsChanged((INFO,)),
])
def test_lora_messages_cross_the_pipe(message: object) -> None:
    assert pickle.loads(pickle.dumps(message)) == message


def test_stats_carry_the_adapter_names() -> None:
    stats = EngineStats(1, 1, 8, 2, 0, 0, 0, 0, 0, 0, 0, 4, running_lora_adapters=("a",),
                        waiting_lora_adapters=("b", "c"))
    assert pickle.loads(pickle.dumps(stats)) == stats


class FakeEngine:
    """add_lora / remove_lora / list_loras / lora_stats, as the engine answers them."""

    def __init__(self, fail: BaseException | None = None, enable_lora: bool = True) -> None:
        self.config = SimpleNamespace(enable_lora=enable_lora)
        self.loaded: dict[str, LoRAInfo] = {"sql": INFO}
        self.fail = fail

    def add_lora(self, name: str, path: str) -> LoRAInfo:
        if self.fail is not None:
            raise self.fail
        self.loaded[name] = LoRAInfo(name, path, 4, 8.0, ("q_proj",), None)
        return self.loaded[name]

    def remove_lora(self, name: str) -> None:
        if name not in self.loaded:
            raise UnknownLoRA(f"no LoRA adapter named {name!r} is loaded")
        del self.loaded[name]

    def list_loras(self) -> list[LoRAInfo]:
        return list(self.loaded.values())

    def lora_stats(self) -> tuple[list[str], list[str]]:
        return ["sql"], ["chat"]


def test_core_answers_loads_and_unloads() -> None:
    engine = FakeEngine()
    done = lora_calls.answer(engine, p.LoadLoRA(7, "chat", "/p/chat"))
    assert done.error is None and done.info is not None and done.info.name == "chat"
    assert [i.name for i in done.loras] == ["sql", "chat"]
    done = lora_calls.answer(engine, p.UnloadLoRA(8, "sql"))
    assert done.error is None and [i.name for i in done.loras] == ["chat"]
    done = lora_calls.answer(engine, p.UnloadLoRA(9, "sql"))
    assert (done.error_kind, done.error) == ("unknown", "no LoRA adapter named 'sql' is loaded")


@pytest.mark.parametrize(("fail", "kind"), [
    (LoRAError("rank 64 is over max_lora_rank 16"), "refused"),
    (OSError("disk gone"), "failed"),
])
def test_a_failed_load_is_an_answer_and_keeps_what_is_loaded(fail: BaseException, kind: str) -> None:
    engine = FakeEngine(fail)
    done = lora_calls.answer(engine, p.LoadLoRA(1, "chat", "/p"))
    assert done.error_kind == kind and str(fail) in (done.error or "")
    assert done.loras == (INFO,) and done.info is None


def test_stats_get_the_names_only_with_lora_on() -> None:
    stats = EngineStats(1, 1, 8, 2, 0, 0, 0, 0, 0, 0, 0, 4)
    with_names = with_lora_stats(FakeEngine(), stats)
    assert (with_names.running_lora_adapters, with_names.waiting_lora_adapters) == (("sql",), ("chat",))
    assert with_lora_stats(FakeEngine(enable_lora=False), stats) is stats
    assert lora_calls.loaded(FakeEngine(enable_lora=False)) == ()


def _scrape(config: Any, stats: EngineStats) -> dict[str, float]:
    return parse_metrics(ServerMetrics("demo", lambda: stats, get_config=lambda: config).render().decode())


def test_lora_requests_info_metric() -> None:
    stats = EngineStats(2, 1, 8, 2, 0, 0, 0, 0, 0, 0, 0, 4, running_lora_adapters=("a", "b"),
                        waiting_lora_adapters=("c",))
    scraped = _scrape(EngineConfig(enable_lora=True, max_loras=3), stats)
    for name in ("vllm:lora_requests_info", "inflight:lora_requests_info"):
        series = f'{name}{{max_lora="3",running_lora_adapters="a,b",waiting_lora_adapters="c"}}'
        assert scraped[series] > 1.7e9  # a timestamp, as vLLM's
    assert not any("lora_requests_info" in key for key in _scrape(EngineConfig(), stats))
    assert not any("lora_requests_info" in key for key in _scrape(None, stats))  # still loading


class CoreEngine(FakeEngine):
    """FakeEngine with what the core's loop calls: one request at a time, one step each."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return False

    def add_requests(self, requests: Any) -> None:
        for r in requests:
            if r.lora_name is not None and r.lora_name not in self.loaded:
                raise UnknownLoRA(f"no LoRA adapter named {r.lora_name!r} is loaded")
        self.added += [r.req_id for r in requests]

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 4)

    def close(self) -> None:
        pass


def _until(end: Any, kind: type) -> tuple[list[object], object]:
    before = []
    while True:
        assert end.poll(30), f"no {kind.__name__}"
        message = end.recv()
        if isinstance(message, kind):
            return before, message
        before.append(message)


def test_core_tells_the_other_front_ends_and_refuses_an_unloaded_adapter() -> None:
    """Two front ends on real pipes: a load's answer goes to the asker and the new list to the
    other; a refused load tells nobody else; a group naming an adapter unloaded meanwhile is
    refused as ``model_not_found`` (HTTP 404), the engine left as it was."""
    import multiprocessing
    import threading

    from inflight.runtime.engine_core.core import EngineCore
    from inflight.runtime.engine_core.inproc import ThreadStepClock
    from inflight.runtime.engine_core.routing import FrontEnds
    from inflight.runtime.sampling_params import SamplingParams

    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
    engine = CoreEngine()
    core = EngineCore(engine, FrontEnds([theirs for _, theirs in pipes]), ThreadStepClock())
    thread = threading.Thread(target=core.serve, args=("the engine core",), daemon=True)
    thread.start()
    asker, other = (ours for ours, _ in pipes)
    try:
        asker.send(p.LoadLoRA(1, "chat", "/p/chat"))
        done = _until(asker, p.LoRADone)[1]
        assert done.call_id == 1 and done.error is None  # type: ignore[attr-defined]
        changed = _until(other, p.LoRAsChanged)[1]
        assert [i.name for i in changed.loras] == ["sql", "chat"]  # type: ignore[attr-defined]
        engine.fail = LoRAError("rank 64 is over max_lora_rank 16")
        asker.send(p.LoadLoRA(2, "big", "/p/big"))
        assert _until(asker, p.LoRADone)[1].error_kind == "refused"  # type: ignore[attr-defined]
        other.send(p.Ping(1))
        before, _ = _until(other, p.Pong)
        assert not any(isinstance(m, p.LoRAsChanged) for m in before)
        request = p.EngineRequest("r1", [1, 2], SamplingParams(max_tokens=2), lora_name="gone")
        asker.send(p.AddGroup(3, (request,)))
        refused = _until(asker, p.Refused)[1]
        assert refused.error.reason == "model_not_found" and refused.error.param == "model"  # type: ignore[attr-defined]
        assert engine.added == []
    finally:
        asker.close()
        other.close()
        thread.join(30)


def test_an_adapter_unloaded_before_admission_is_a_404() -> None:
    from inflight.runtime.outputs import RequestRejectedError
    from inflight.runtime.server.errors import from_rejection

    error = from_rejection(RequestRejectedError("no LoRA adapter named 'x' is loaded", "model_not_found", "model"),
                           "prompt")
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
