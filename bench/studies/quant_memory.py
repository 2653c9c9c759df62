"""SmolLM2-135M served from its GGUF blocks vs dequantized to float32: weight bytes and decode speed.

    python -m bench.studies.quant_memory [--steps 48] [--models-dir models]

Prints the resident weight bytes of both engines and the decode milliseconds per step at
batch 1 and 8 (greedy, EOS ignored; a step's time is the generation time with ``steps + 1``
tokens minus the time with one, over ``steps``), and the quantized/float32 ratios. The
numbers depend on the machine (its cores and memory bandwidth); nothing here is asserted.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.model.gguf_smollm2 import default_models_dir, ensure_smollm2
from inflight.runtime.model.quantized import resident_weight_bytes

ENGINE = dict(max_model_len=1024, num_kv_blocks=256, max_num_sequences=8, device="cpu", dtype="float32")
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2]  # a short fixed prompt (ids)


def _seconds(llm: LLM, batch: int, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([list(PROMPT) for _ in range(batch)], params)
    return time.perf_counter() - start


def decode_ms_per_step(llm: LLM, batch: int, steps: int) -> float:
    _seconds(llm, batch, 4)  # warm-up (kernel builds, allocator)
    full = min(_seconds(llm, batch, steps + 1) for _ in range(2))
    prefill = min(_seconds(llm, batch, 1) for _ in range(2))
    return (full - prefill) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--models-dir", type=Path, default=default_models_dir())
    args = parser.parse_args(argv)
    model_dir = ensure_smollm2(args.models_dir)
    dense = LLM(str(model_dir), quantization="none", **ENGINE)
    quant = LLM(str(model_dir), quantization="gguf", **ENGINE)  # the directory links to its GGUF file
    dense_bytes = resident_weight_bytes(dense.engine.runner.model)
    quant_bytes = resident_weight_bytes(quant.engine.runner.model)
    print(f"weights resident: float32 {dense_bytes / 2**20:.1f} MiB, gguf blocks {quant_bytes / 2**20:.1f} MiB "
          f"(ratio {quant_bytes / dense_bytes:.3f}; {quant.engine.runner.quantization.why})")
    for batch in (1, 8):
        d = decode_ms_per_step(dense, batch, args.steps)
        q = decode_ms_per_step(quant, batch, args.steps)
        print(f"decode batch {batch}: float32 {d:.2f} ms/step, gguf blocks {q:.2f} ms/step (ratio {q / d:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
