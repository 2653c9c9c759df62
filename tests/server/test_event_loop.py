"""The front end's event loop (``--event-loop``, ``server/event_loop.py``): ``auto`` and
``uvloop`` run on uvloop, ``asyncio`` on the standard library's loop; without uvloop ``auto``
says so and runs on asyncio, while ``uvloop`` is refused at start, before anything runs."""

from __future__ import annotations

import asyncio
import importlib
import logging
import warnings
from types import ModuleType

import pytest

from inflight.runtime.cli.command import main
from inflight.runtime.server import event_loop
from inflight.runtime.server.state import ServerSettings

uvloop = pytest.importorskip("uvloop")  # a serving dependency on Linux: installed by make run and make test


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_the_standard_loop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inflight.server")
    assert issubclass(event_loop.run(_loop_type(), "auto"), uvloop.Loop)
    assert issubclass(event_loop.run(_loop_type(), "uvloop"), uvloop.Loop)
    plain = event_loop.run(_loop_type(), "asyncio")
    assert not issubclass(plain, uvloop.Loop) and plain.__module__.startswith("asyncio")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event loop: ")]
    assert said == [f"event loop: uvloop {uvloop.__version__}"] * 2 + ["event loop: asyncio"]


def test_the_result_and_an_exception_come_back_as_from_asyncio_run() -> None:
    async def fails() -> None:
        raise KeyError("inside")

    async def answers() -> int:
        await asyncio.sleep(0)
        return 7

    assert event_loop.run(answers(), "auto") == 7
    with pytest.raises(KeyError, match="inside"):
        event_loop.run(fails(), "auto")


def _without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> ModuleType:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, package)

    monkeypatch.setattr(event_loop.importlib, "import_module", import_module)


def test_without_uvloop_auto_says_so_and_uvloop_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    _without_uvloop(monkeypatch)
    caplog.set_level(logging.INFO, logger="inflight.server")
    assert not issubclass(event_loop.run(_loop_type(), "auto"), uvloop.Loop)
    assert "event loop: asyncio (uvloop is not installed)" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the coroutine is closed, not left "never awaited"
        with pytest.raises(event_loop.EventLoopUnavailableError, match="pip install uvloop"):
            event_loop.run(_loop_type(), "uvloop")


def test_the_cli_refuses_uvloop_without_it_and_an_unknown_loop(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _without_uvloop(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "some-model", "--event-loop", "uvloop"])
    assert exited.value.code == 2
    assert "--event-loop uvloop: uvloop is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "some-model", "--event-loop", "trio"])
    assert "invalid choice: 'trio'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="event_loop 'trio'"):
        ServerSettings(model_name="m", event_loop="trio")
