"""``inflight serve``: the command line (``command``; ``main`` runs it), the vLLM flag ledger (``vllm_flags``,
``vllm_flag_rows``, ``vllm_flag_rows_engine``, ``vllm_flag_kinds``, ``vllm_aliases``) and the start-up checks (``preflight``,
``serving_dir``)."""


def main(argv: list[str] | None = None) -> int:
    """``inflight``'s entry point (pyproject's ``inflight.runtime.cli:main``): the command line
    in :mod:`.command`, imported only when a command runs."""
    from inflight.runtime.cli.command import main as run

    return run(argv)
