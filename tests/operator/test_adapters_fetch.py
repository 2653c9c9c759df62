"""An hf adapter's init container (issue 49), run as the kubelet would against a local fake Hub:
the adapter's files land beside the model in the shared cache, where the runtime is told to load
them from; a repo without ``adapter_config.json`` fails the container with the reason."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import subprocess
import sys

import pytest

from inflight.operator import render
from inflight.operator.adapter_source import adapter_path
from inflight.operator.render import Owner
from tests.operator.fake_hub import FakeHub
from tests.operator.helpers import make_spec
from tests.operator.test_model_fetch import TOKEN, _rooted, _run_fetch
from tests.server.lora_adapters import make_adapter

SPEC = {"model": {"servedModelName": "tiny", "hf": {"repoId": "org/tiny-llama"}, "cache": {"claimName": "cache"}},
        "resources": {"gpus": 0},
        "adapters": [{"name": "sql", "source": {"hf": {"repo": "org/sql-lora", "revision": "main",
                                                      "tokenSecret": {"name": "hf-token"}}}}]}


@pytest.fixture(scope="module")
def adapter_repo(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("adapter-hub")
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(root / "tiny"), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    return make_adapter(root / "tiny", root / "sql-lora", seed=1)


@pytest.mark.slow
def test_hf_adapter_is_fetched_into_the_model_cache(adapter_repo: pathlib.Path, tmp_path: pathlib.Path) -> None:
    spec = make_spec(SPEC)
    pod = render.render_deployment(spec, Owner("tiny", "u1"), 1)["spec"]["template"]["spec"]
    (container,) = [c for c in pod["initContainers"] if c["name"] == "adapter-sql"]
    dest = pathlib.Path(_rooted(adapter_path(spec.adapters[0], spec.model), tmp_path))
    not_an_adapter = tmp_path / "not-an-adapter"
    not_an_adapter.mkdir()
    (not_an_adapter / "config.json").write_text("{}")

    same: list[bool] = []

    async def scenario() -> tuple[tuple[int, str], tuple[int, str]]:
        hub = await FakeHub("org/sql-lora", adapter_repo, token=TOKEN).start()
        try:
            fetched = await _run_fetch(container, tmp_path, hub, TOKEN)
        finally:
            await hub.stop()
        same.extend((dest / f).read_bytes() == (adapter_repo / f).read_bytes()
                    for f in ("adapter_config.json", "adapter_model.safetensors"))
        shutil.rmtree(dest)  # the second repo must be judged on its own files
        bad = await FakeHub("org/sql-lora", not_an_adapter, token=TOKEN).start()
        try:
            refused = await _run_fetch(container, tmp_path, bad, TOKEN)
        finally:
            await bad.stop()
        return fetched, refused

    (rc, out), (bad_rc, bad_out) = asyncio.run(scenario())
    assert rc == 0 and "downloaded" in out, out
    assert TOKEN not in out
    assert str(dest).startswith(str(tmp_path / "adapters" / "hf" / "org--sql-lora"))
    assert same == [True, True]  # the adapter's files, where the runtime loads them from
    assert bad_rc == 1 and "no adapter_config.json" in bad_out and "not a LoRA adapter" in bad_out, bad_out
