"""The vLLM flag ledger against vLLM 0.32.0's own parser (tests/runtime/data/vllm_0_32_serve_flags.txt):
every action of ``vllm serve`` has exactly one row, with the same spellings (``--no-`` forms included)
and the same number of values, and every row outside ``LEGACY`` is one of those actions."""

from __future__ import annotations

from pathlib import Path

from inflight.runtime.cli.vllm_flags import FLAGS, LEGACY, VLLM_RELEASE, VllmFlag, by_name

DATA = Path(__file__).resolve().parent / "data" / "vllm_0_32_serve_flags.txt"


def _actions() -> list[tuple[tuple[str, ...], str]]:
    """(spellings, nargs) of each action, from the data file."""
    actions = []
    for line in DATA.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        *names, nargs = line.split()
        assert nargs.startswith("nargs="), line
        actions.append((tuple(names), nargs.removeprefix("nargs=")))
    return actions


def _spellings(flag: VllmFlag) -> set[str]:
    return {*flag.names, *([flag.negative] if flag.negative else [])}


def test_every_vllm_032_flag_resolves_to_one_row_with_its_spellings_and_nargs() -> None:
    table = by_name()
    missing = sorted(name for names, _ in _actions() for name in names if name not in table)
    assert not missing, f"vLLM {VLLM_RELEASE} flags without a row in vllm_flag_rows*.py: {missing}"
    for names, nargs in _actions():
        rows = {id(table[n]): table[n] for n in names}
        assert len(rows) == 1, f"{names} resolve to more than one row"
        row = next(iter(rows.values()))
        assert _spellings(row) == set(names), f"{row.name}: spellings {sorted(_spellings(row))}, vLLM {names}"
        assert str(row.nargs) == nargs, f"{row.name}: nargs {row.nargs}, vLLM {nargs}"


def test_every_current_row_is_a_vllm_032_flag_and_legacy_rows_are_not() -> None:
    known = {name for names, _ in _actions() for name in names}
    current = [flag for flag in FLAGS if flag not in LEGACY]
    assert len(current) == len(_actions()) == 316  # vLLM 0.32.0: 317 parser actions, --help left out
    stale = [flag.name for flag in current if not _spellings(flag) <= known]
    assert not stale, f"rows of flags vLLM {VLLM_RELEASE} lacks (move them to LEGACY): {stale}"
    revived = [flag.name for flag in LEGACY if _spellings(flag) & known]
    assert not revived, f"LEGACY rows of flags vLLM {VLLM_RELEASE} has: {revived}"
