"""The CPU KV cache asks for transparent huge pages (inflight.kernels.cpu_huge_pages): the
kernel's mode is read from its file, only whole 2 MiB pages inside a tensor are advised, the
advice reaches the kernel (the mapping is marked ``hg`` in ``/proc/self/smaps``), a CPU engine's
cache gets it and a served engine says so, and the switch or a ``never`` kernel turns it off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from inflight.kernels import cpu_huge_pages
from inflight.kernels.cpu_huge_pages import HUGE_PAGE_BYTES, advise, cache_zeros, thp_mode, zeros_on_huge_pages
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

LINUX_THP = sys.platform.startswith("linux") and thp_mode() in ("always", "madvise")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                            ("[always] madvise never\n", "always"),
                                            ("always madvise [never]\n", "never"), ("garbled\n", "absent")])
def test_the_mode_is_the_bracketed_word(tmp_path, text, mode) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode
    assert thp_mode(tmp_path / "missing") == "absent"


def test_only_the_whole_huge_pages_inside_a_tensor_are_advised(monkeypatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(cpu_huge_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    big = torch.empty(3 * HUGE_PAGE_BYTES // 4 + 123)  # 3 huge pages of bytes and a bit: 2 or 3 whole ones
    advised = advise(big)
    (start, length, advice), = calls
    first, end = big.data_ptr(), big.data_ptr() + big.numel() * 4
    assert advice == 14 and start % HUGE_PAGE_BYTES == 0 and length % HUGE_PAGE_BYTES == 0
    assert first <= start < first + HUGE_PAGE_BYTES and end - HUGE_PAGE_BYTES < start + length <= end
    assert advised == length >= 2 * HUGE_PAGE_BYTES
    calls.clear()
    assert advise(torch.empty(1000)) == 0 and not calls  # no whole huge page inside
    assert advise(torch.empty(2, HUGE_PAGE_BYTES).t()) == 0 and not calls  # not contiguous
    monkeypatch.setattr(cpu_huge_pages, "_madvise", lambda: lambda *args: -1)
    assert advise(big) == 0  # refused


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux with transparent huge pages in always or madvise mode")
def test_a_cache_tensor_is_zero_and_its_mapping_is_advised(monkeypatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", "1")
    cache = zeros_on_huge_pages((1024, 16, 2, 64), torch.float32)  # 8 MiB
    assert cache.shape == (1024, 16, 2, 64) and cache.dtype == torch.float32 and not cache.any()
    assert "hg" in _vm_flags(cache.data_ptr() + cache.numel() * 2)  # the middle: inside a whole huge page
    assert cpu_huge_pages.huge_pages_sentence() == "on transparent huge pages"


def test_the_switch_and_a_never_kernel_ask_for_nothing(monkeypatch, tmp_path) -> None:
    asked: list[torch.Tensor] = []
    monkeypatch.setattr(cpu_huge_pages, "advise", asked.append)
    monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", "0")
    assert not zeros_on_huge_pages((64, 16, 2, 64), torch.float32).any()
    assert cpu_huge_pages.huge_pages_sentence() == "on small pages (INFLIGHT_CPU_HUGE_PAGES=0)"
    monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", "1")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(cpu_huge_pages, "THP_ENABLED", never)
    monkeypatch.setattr(cpu_huge_pages, "thp_mode", lambda path=never: thp_mode(path))
    zeros_on_huge_pages((64, 16, 2, 64), torch.float32)
    assert cpu_huge_pages.wanted() == "transparent huge pages never" and not asked
    meta = cache_zeros((4, 4), torch.float32, torch.device("meta"))  # not the CPU: plain zeros, never advised
    assert meta.device.type == "meta" and not asked


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux with transparent huge pages in always or madvise mode")
def test_a_cpu_engines_kv_cache_is_advised_and_serves_the_same_tokens(llama_dir, monkeypatch) -> None:
    config = EngineConfig(device="cpu", dtype="float32", kernel_backend="cpu", num_kv_blocks=8192,
                          max_num_sequences=4, max_num_tokens=64)  # fmt: skip
    tokens, said = {}, []
    for switch in ("0", "1"):
        monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", switch)
        engine = LLMEngine.from_model_dir(llama_dir, config, progress=said.append)
        try:
            k, v = engine.runner.kv_caches[0]
            middle = k.data_ptr() + k.numel() * k.element_size() // 2
            assert k.numel() * k.element_size() >= 3 * HUGE_PAGE_BYTES and not k.any() and not v.any()
            assert ("hg" in _vm_flags(middle)) == (switch == "1")
            for i in range(3):
                engine.add_request(str(i), [5 + i, 9, 11], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            out: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.req_id, []).extend(o.new_token_ids)
            tokens[switch] = out
        finally:
            engine.close()
    assert tokens["0"] == tokens["1"] and all(len(t) == 6 for t in tokens["1"].values())
    kv_lines = [line for line in said if line.startswith("KV cache:")]
    assert len(kv_lines) == 2 and "on small pages (INFLIGHT_CPU_HUGE_PAGES=0)" in kv_lines[0]
    assert "on transparent huge pages" in kv_lines[1]
