"""Linear weights prepacked for MKL or oneDNN (inflight/kernels/cpu_packed.py) against the torch
reference, and their installation in a loaded model: which weights are packed, in which format,
what stays float, and that the float copies are gone unless kept."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from inflight.kernels import cpu_linear, cpu_native, cpu_packed, cpu_prepack, cpu_weight_layout, reference
from inflight.kernels.cpu_packed import PackedLinearWeight, pack_linear_weight, packed_linear
from inflight.kernels.cpu_prepack import prepack_linears
from tests.kernels.threads import with_threads

pytestmark = pytest.mark.skipif(not cpu_packed.mkl_packing_available(), reason="torch built without MKL")
FORMATS = [pytest.param(f, marks=pytest.mark.skipif(not cpu_packed.packing_available(f), reason=f"torch lacks {f}"))
           for f in cpu_packed.FLOAT32_FORMATS]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pack_threads", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("blocks", [1, 3])
def test_every_row_count_matches_reference(fmt: str, pack_threads: int, threads: int, with_bias: bool,
                                           blocks: int) -> None:
    """One packed weight serves every batch size (both formats pack for one; the call passes its
    own), packed with one thread count and run with another (decode lanes run on one thread),
    MKL's whole or in column blocks (oneDNN's always whole)."""
    gen = torch.Generator().manual_seed(threads * 10 + pack_threads)
    weight = torch.randn(1000, 200, generator=gen) * 0.05  # in_features not a multiple of the vector width
    bias = torch.randn(1000, generator=gen) if with_bias else None
    packed = with_threads(pack_threads, pack_linear_weight, weight, False, fmt, num_blocks=blocks)
    assert packed is not None and packed.shape == weight.shape and packed.nbytes == weight.numel() * 4
    assert packed.fmt == fmt and len(packed.packed) == (blocks if fmt == "mkl" else 1)
    assert (packed.mkl_table is not None) == (fmt == "mkl")
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 32, 37, 64, 100, 512):
        x = torch.randn(rows, 200, generator=gen)
        got = with_threads(threads, packed_linear, x, packed, bias)
        torch.testing.assert_close(got, reference.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        # the native bundle's linear: the same packed product (bit-equal on Intel; MKL splits a 2-thread
        # product differently between the two callers on AMD EPYC, a last-bit difference)
        torch.testing.assert_close(got, with_threads(threads, cpu_native.linear, x, packed, bias), atol=2e-6, rtol=1e-6)


def test_column_blocks_are_whole_panels_none_too_narrow() -> None:
    assert cpu_weight_layout.column_starts(1000, 1) == (0,)
    assert cpu_weight_layout.column_starts(1000, 2) == (0, 496)  # 63 groups of 16: 31 and 32
    assert cpu_weight_layout.column_starts(1000, 3) == (0, 336, 672)
    assert cpu_weight_layout.column_starts(130, 4) == (0, 64)  # 130 // 64 = 2 blocks at most
    assert cpu_weight_layout.column_starts(63, 8) == (0,)  # narrower than one block
    for out, blocks in ((512, 2), (3072, 16), (8192, 7), (100, 3)):
        starts = cpu_weight_layout.column_starts(out, blocks)
        ends = (*starts[1:], out)
        assert starts[0] == 0 and all(s % cpu_weight_layout.PANEL_COLS == 0 for s in starts)
        assert all(e - s >= min(out, cpu_weight_layout.MIN_BLOCK_COLS) for s, e in zip(starts, ends, strict=True))
        assert len(starts) <= blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_shapes_empty_batches_and_strided_input(fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 53, generator=gen)
    packed = pack_linear_weight(weight, fmt=fmt)
    assert packed is not None
    x = torch.randn(7, 106, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(packed_linear(x, packed), reference.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert packed_linear(torch.empty(0, 53), packed).shape == (0, 37)
    x3 = torch.randn(2, 3, 53, generator=gen)  # leading dimensions kept
    torch.testing.assert_close(packed_linear(x3, packed), reference.linear(x3, weight), atol=1e-5, rtol=1e-5)
    wide = torch.randn(200, 53, generator=gen)
    blocked = pack_linear_weight(wide, fmt=fmt, num_blocks=2)
    assert blocked is not None
    for x in (torch.randn(7, 106, generator=gen)[:, ::2], torch.randn(2, 3, 53, generator=gen), torch.empty(0, 53)):
        torch.testing.assert_close(packed_linear(x, blocked), reference.linear(x, wide), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cpu_native.linear(x, blocked), reference.linear(x, wide), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown packed format"):
        pack_linear_weight(weight, fmt="blas")


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_stays_float32_and_refuses_other_inputs(fmt: str) -> None:
    """oneDNN/MKL may use bfloat16 (AMX) for float32 when told to; the packed product must keep
    float32's error (~1e-6 relative), far below bfloat16's (~1e-3)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 1536, generator=gen) * 0.05
    x = torch.randn(64, 1536, generator=gen)
    exact = x.double() @ weight.double().T
    packed = pack_linear_weight(weight, fmt=fmt)
    assert packed is not None
    error = float((packed_linear(x, packed).double() - exact).abs().max() / exact.abs().max())
    assert error < 1e-5
    with pytest.raises(ValueError, match="float32 CPU input"):
        packed_linear(x.bfloat16(), packed)
    with pytest.raises(ValueError, match="float32 CPU weights"):
        pack_linear_weight(weight.bfloat16())


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24, bias=True)
        self.down = nn.Linear(24, 16, bias=False)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.narrow = nn.Linear(16, 8).to(torch.bfloat16)


def test_prepack_linears_swaps_float_weights_and_keeps_shared_ones() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    weights = {name: model.get_submodule(name).weight.detach().clone() for name in ("proj", "down")}
    summary = prepack_linears(model)
    assert summary.num_packed == 2 and summary.shared == ("head",) and summary.disagreed == ()
    assert summary.packed_bytes == (24 * 16 + 16 * 24) * 4
    for name, weight in weights.items():
        module = model.get_submodule(name)
        assert isinstance(module.weight, PackedLinearWeight) and "weight" not in module._parameters
        x = torch.randn(5, weight.shape[1])
        torch.testing.assert_close(cpu_native.linear(x, module.weight, module.bias),
                                   reference.linear(x, weight, module.bias), atol=1e-5, rtol=1e-5)
    assert model.head.weight is model.embed.weight  # the tied head stays the embedding's table
    assert isinstance(model.narrow.weight, nn.Parameter)  # bfloat16: not packed
    assert "2 linears prepacked" in summary.describe() and "head kept float (shared)" in summary.describe()


def test_with_float_copies_a_tied_head_is_packed_over_the_embedding_table() -> None:
    """The tied head's float weight stays for the embedding anyway, so with float copies it is
    packed and that table is its float copy: no second copy of the table, and both modules
    still compute what they did."""
    torch.manual_seed(0)
    model = _Tiny()
    table = model.embed.weight.detach().clone()
    summary = prepack_linears(model, keep_float=True)
    assert summary.num_packed == 3 and summary.shared == () and summary.float_copies
    head = model.head.weight
    assert isinstance(head, PackedLinearWeight) and isinstance(model.embed.weight, nn.Parameter)
    assert head.float_rows is not None and head.float_rows.data_ptr() == model.embed.weight.data_ptr()
    ids = torch.tensor([3, 0, 49])
    torch.testing.assert_close(model.embed(ids), table[ids])
    for rows in (2, 40):  # the float copy's few-row kernel, and the packed product
        x = torch.randn(rows, 16)
        torch.testing.assert_close(cpu_native.linear(x, head), reference.linear(x, table), atol=1e-5, rtol=1e-5)
    assert "kept float (shared)" not in summary.describe()


def test_a_weight_whose_packed_product_disagrees_stays_float(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_packed, "packed_linear", lambda x, w, bias=None: torch.zeros(x.shape[0], w.shape[0]))
    model = nn.Sequential(nn.Linear(8, 8))
    with caplog.at_level(logging.WARNING, logger="inflight.kernels.cpu_packed"):
        summary = prepack_linears(model)
    assert summary.num_packed == 0 and summary.disagreed == ("0",)
    assert isinstance(model[0].weight, nn.Parameter) and "disagreed" in caplog.text


def test_engine_runs_on_packed_weights_unless_switched_off(tiny_model_dir, monkeypatch) -> None:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine

    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32, max_num_sequences=4)
    runners = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("INFLIGHT_CPU_PREPACK", setting)
        runners[setting] = LLMEngine.from_model_dir(tiny_model_dir, config).runner
    packed, plain = runners["1"], runners["0"]
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj.weight, PackedLinearWeight)
    assert isinstance(packed.model.layers[0].mlp.down_proj.weight, PackedLinearWeight)
    assert isinstance(plain.model.layers[0].self_attn.qkv_proj.weight, nn.Parameter)
    assert packed._num_params == plain._num_params  # the step-size thresholds see the same model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_kept_float_copy_takes_the_few_row_products(threads: int, fmt: str) -> None:
    """With its float copy in panels, a packed weight's products of at most PANEL_MAX_ROWS rows run
    the panel kernel on that copy, bigger ones the packed GEMM; a shared weight's row-major copy
    takes products of at most FLOAT_COPY_MAX_ROWS rows through the few-row kernel."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 70, generator=gen) * 0.1
    bias = torch.randn(300, generator=gen)
    packed = pack_linear_weight(weight, keep_float=True, fmt=fmt)
    assert packed is not None and packed.float_rows is None and packed.has_float_copy
    assert torch.equal(cpu_weight_layout.from_panels(packed.panels, 300), weight)
    assert packed.nbytes == weight.numel() * 4 + packed.panels.numel() * 4  # 300 columns: 304 in panels
    limit = cpu_packed.PANEL_MAX_ROWS
    for rows in (1, 3, 8, 17, limit, limit + 1, 80):
        x = torch.randn(rows, 70, generator=gen)
        got = with_threads(threads, cpu_native.linear, x, packed, bias)
        torch.testing.assert_close(got, reference.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        if rows <= limit:
            assert torch.equal(got, with_threads(threads, cpu_linear.panel_rows, cpu_native._lib(), x, packed.panels, 300, bias, threads))
        else:
            assert torch.equal(got, with_threads(threads, packed_linear, x, packed, bias))
    shared = pack_linear_weight(weight, keep_float=True, fmt=fmt, shared=True)
    assert shared is not None and shared.panels is None and torch.equal(shared.float_rows, weight)
    assert shared.nbytes == 2 * weight.numel() * 4
    few = cpu_packed.FLOAT_COPY_MAX_ROWS
    for rows in (1, few, few + 1):
        x = torch.randn(rows, 70, generator=gen)
        got = with_threads(threads, cpu_native.linear, x, shared, bias)
        if rows <= few:
            assert torch.equal(got, with_threads(threads, cpu_linear.few_rows, cpu_native._lib(), x, weight, bias, threads))
        else:
            assert torch.equal(got, with_threads(threads, packed_linear, x, shared, bias))
    x = torch.randn(2, 3, 70, generator=gen)  # not 2-D: the packed GEMM takes any leading shape
    assert torch.equal(cpu_native.linear(x, packed), packed_linear(x, packed))


def test_float_copies_are_kept_off_intel_cpus_unless_told(tmp_path, monkeypatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")
    assert cpu_prepack.cpu_vendor(cpuinfo) == "AuthenticAMD"
    assert cpu_prepack.cpu_vendor(tmp_path / "missing") == ""
    monkeypatch.delenv("INFLIGHT_CPU_FLOAT_COPY", raising=False)
    assert cpu_prepack.float_copies_wanted("AuthenticAMD") and cpu_prepack.float_copies_wanted("")
    assert not cpu_prepack.float_copies_wanted("GenuineIntel")
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", "1")
    assert cpu_prepack.float_copies_wanted("GenuineIntel")
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", "0")
    assert not cpu_prepack.float_copies_wanted("AuthenticAMD")


def test_prepack_keeps_the_float_weights_when_asked() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
    weights = [model[0].weight.detach().clone(), model[1].weight.detach().clone()]
    summary = prepack_linears(model, keep_float=True)
    assert summary.num_packed == 2 and summary.float_copies and "float weights kept" in summary.describe()
    assert summary.packed_bytes == 2 * 4 * (16 * 32 + 32 * 8) + 4 * 32 * 8  # 8 columns pad to a 16-wide panel
    for layer, weight in zip(model, weights, strict=True):
        assert isinstance(layer.weight, PackedLinearWeight) and layer.weight.float_rows is None
        assert torch.equal(cpu_weight_layout.from_panels(layer.weight.panels, weight.shape[0]), weight)
    plain = nn.Sequential(nn.Linear(16, 32))
    summary = prepack_linears(plain)
    assert not plain[0].weight.has_float_copy and "float copies freed" in summary.describe()


def test_the_pack_format_is_mkl_on_intel_and_onednn_elsewhere_unless_told(monkeypatch) -> None:
    monkeypatch.delenv("INFLIGHT_CPU_PACK_FORMAT", raising=False)
    assert cpu_prepack.pack_format("GenuineIntel") == ("mkl", "GenuineIntel CPU")
    assert cpu_prepack.pack_format("AuthenticAMD") == ("onednn", "AuthenticAMD CPU")
    assert cpu_prepack.pack_format("") == ("onednn", "unknown CPU")
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", " oneDNN ")
    assert cpu_prepack.pack_format("GenuineIntel") == ("onednn", "INFLIGHT_CPU_PACK_FORMAT")
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", "blas")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_PACK_FORMAT must be one of mkl, onednn"):
        cpu_prepack.pack_format()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_load_line_names_the_format_and_why(fmt: str, monkeypatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", fmt)
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", "0")
    model = nn.Sequential(nn.Linear(16, 32))
    line = cpu_prepack.prepack_detail(model, "cpu-native", torch.device("cpu"), torch.float32)
    name = {"mkl": "MKL", "onednn": "oneDNN"}[fmt]
    assert f"1 linears prepacked for {name} [INFLIGHT_CPU_PACK_FORMAT]" in line
    assert model[0].weight.fmt == fmt
    monkeypatch.setattr(cpu_packed, "packing_available", lambda f: f != fmt)  # a torch without this format's ops
    other = nn.Sequential(nn.Linear(16, 32))
    line = cpu_prepack.prepack_detail(other, "cpu-native", torch.device("cpu"), torch.float32)
    assert f"[torch has no {fmt} packed GEMM]" in line and other[0].weight.fmt != fmt
    monkeypatch.setattr(cpu_packed, "packing_available", lambda f: False)
    assert "unpacked (torch has neither" in cpu_prepack.prepack_detail(nn.Sequential(nn.Linear(4, 4)), "cpu-native",
                                                                       torch.device("cpu"), torch.float32)
