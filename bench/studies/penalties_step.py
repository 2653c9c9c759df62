"""``python -m bench.studies.penalties_step``: the CPU time of a sampling step with penalties on,
from the rows' token lists (each step re-reads every prompt and output on the host and counts it
with ``np.unique``) against per-request state on the device (worker/penalty_state.py: filled once,
then followed from the sampled ids).

For 8, 64 and 256 rows, greedy and at temperature 0.8 (every row with repetition, frequency and
presence penalties, prompts of ``--prompt-len`` tokens, outputs growing by one token a step;
the greedy step is mostly the penalties, the sampled one mostly the draw), times whole steps of the real
:class:`Sampler` on the CPU device (``start_sample`` and its ``result``), the two ways
interleaved rep by rep so both see the same machine; the state's first step (its fill) is done
before timing. Prints the median process CPU time per step and the ratio. On the CPU the
"device" work is CPU work too (the state's penalties are dense over the vocabulary, as vLLM's);
on CUDA it runs on the GPU and the host only builds the step's small index tensors.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.penalty_state import RequestPenalties
from inflight.runtime.worker.sampler import Sampler, SamplingRow

PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
MODES = {"greedy": SamplingParams(temperature=0.0, **PENALTIES),
         "temperature 0.8": SamplingParams(temperature=0.8, seed=1, **PENALTIES)}  # fmt: skip


class _Batch:
    """``n`` requests, their outputs growing by the tokens each step samples."""

    def __init__(self, params: SamplingParams, n: int, prompt_len: int, vocab: int, stateful: bool) -> None:
        self.params = params
        g = torch.Generator().manual_seed(n)
        self.prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
        self.outputs: list[list[int]] = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(n)]
        self.gens = [torch.Generator().manual_seed(i) for i in range(n)]
        self.holders = [RequestPenalties() if stateful else None for _ in range(n)]
        self.sampler = Sampler(torch.device("cpu"))

    def step(self, logits: torch.Tensor) -> float:
        """One sampling step; its process CPU time in ms."""
        rows = [SamplingRow(self.params, p, o, g, (0,), None, h)
                for p, o, g, h in zip(self.prompts, self.outputs, self.gens, self.holders, strict=True)]  # fmt: skip
        start = time.process_time()
        tokens = self.sampler.start_sample(logits, rows).result().token_ids
        elapsed = time.process_time() - start
        for out, t in zip(self.outputs, tokens, strict=True):
            out.append(t)
        return elapsed * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, prompts of {args.prompt_len} tokens, {args.reps} interleaved reps, "
          f"{args.threads} torch thread(s); median process CPU ms per sampling step\n")  # fmt: skip
    print(f"{'sampling':<16} {'rows':>5} {'token lists ms':>15} {'device state ms':>16} {'state / lists':>14}")
    for (mode, params), n in itertools.product(MODES.items(), args.rows):
        lists = _Batch(params, n, args.prompt_len, args.vocab, stateful=False)
        state = _Batch(params, n, args.prompt_len, args.vocab, stateful=True)
        g = torch.Generator().manual_seed(0)
        state.step(torch.randn(n, args.vocab, generator=g))  # the fill: once per request
        lists.step(torch.randn(n, args.vocab, generator=g))
        before, after = [], []
        for rep in range(args.reps):
            logits = torch.randn(n, args.vocab, generator=g)
            pair = [(lists, before), (state, after)]
            for batch, times in pair if rep % 2 == 0 else pair[::-1]:
                times.append(batch.step(logits.clone()))
        b, a = statistics.median(before), statistics.median(after)
        print(f"{mode:<16} {n:>5} {b:>15.2f} {a:>16.2f} {a / b:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
