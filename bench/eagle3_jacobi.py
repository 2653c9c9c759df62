"""Training data for an EAGLE-3 head from prefills alone (for :mod:`bench.train_eagle3`
``--data jacobi``): the served model's greedy answers found by Jacobi fixed-point iteration
instead of token-by-token decoding.

Decoding an answer costs one engine step per token; a prefill runs every position of a sequence
in one batched pass, far cheaper per token on a CPU. Each sequence starts as the chat prompt
followed by a draft answer (the prompt's own passage: for copying, rewriting and summarising
prompts the model's answer stays close to it). One iteration prefills every sequence whole, the
runner's execute hook catching the hidden states entering the head's three aux layers and the
model's greedy next token at *every* position (its own logits, as served); the answer is then
replaced by those next tokens (answer token ``j`` becomes the model's choice after the prompt and
answer tokens ``< j``) and cut at the first end-of-sequence token. After ``m`` iterations at least
the first ``m`` answer tokens are the model's greedy answer, and in practice most of them, as in
Jacobi decoding; where the sequence still departs from it, the labels are still the model's own
greedy next token after that prefix, which is what verification checks. The examples are those of
the last iteration: every label is the served model's argmax, so the head learns exactly what it
is accepted for. Also holds the execute-hook pieces both data modes use (:func:`forward_catching`,
:func:`served_tables`). Knows nothing about the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.eagle3_fit import Example
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.aux_hidden import AuxHidden
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.batch_inputs import BatchInputs, packed_order


@dataclass(frozen=True, slots=True)
class JacobiData:
    """The last iteration's examples, the served model's embedding table ``[vocab, hidden]`` and
    final norm ``[hidden]``, and per iteration the share of answer tokens that changed (how far
    the iteration still moved) and the share on the model's greedy path at the end."""

    examples: list[Example]
    embed: torch.Tensor
    final_norm: torch.Tensor
    changed: list[float]
    on_path: float


class _Prefiller:
    """One engine prefilling whole sequences (``max_tokens=1``), catching aux states and the
    greedy next token at every position."""

    def __init__(self, model_dir: Path, aux_ids: tuple[int, ...], longest: int) -> None:
        self.engine = LLMEngine.from_model_dir(
            model_dir,
            EngineConfig(num_kv_blocks=4096, enable_chunked_context=False, max_model_len=longest,
                         enable_prefix_caching=False, max_num_tokens=4096),  # fmt: skip
        )
        self.aux_ids = aux_ids
        self.caught: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.engine.runner.execute_hook = self._hook

    def _hook(self, batch: BatchInputs) -> torch.Tensor:
        runner = self.engine.runner
        hidden, states, spans = forward_catching(runner, batch, self.aux_ids)
        logits = runner.model.compute_logits(hidden, runner.ops)
        greedy = logits.argmax(-1)
        for chunk, rows in spans:
            if chunk.start != 0:
                raise RuntimeError("a sequence was prefilled in pieces; raise max_num_tokens")
            self.caught[chunk.req_id] = (states[rows].clone(), greedy[rows].clone())
        return logits[batch.sample_indices]

    def run(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Aux states ``[n, 3 * hidden]`` (bf16) and greedy next tokens ``[n]`` of each sequence."""
        self.caught.clear()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for first in range(0, len(seqs), 512):  # under the engine's waiting-queue bound
            for i in range(first, min(first + 512, len(seqs))):
                self.engine.add_request(str(i), seqs[i], params)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        return [self.caught.pop(str(i)) for i in range(len(seqs))]

    def close(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.engine.runner.execute_hook = None
        tables = served_tables(self.engine.runner)
        self.engine.close()
        return tables


def forward_catching(runner: Any, batch: BatchInputs, aux_ids: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[ScheduledChunk, slice]]]:  # fmt: skip
    """The runner's forward of ``batch`` (an execute hook's work) catching the hidden states
    entering layers ``aux_ids``: its hidden states, the aux states ``[num_tokens, 3 * hidden]``
    (bf16) and each chunk's rows in them (every chunk samples: prompts are never chunked)."""
    aux = AuxHidden(aux_ids)
    hidden = runner.model(batch.input_ids, batch.positions, runner.cos_sin, runner.kv_caches, batch.meta,
                          runner.ops, aux=aux)  # fmt: skip
    states = torch.cat(aux.hidden, -1).to(torch.bfloat16)
    spans, row = [], 0
    for chunk in packed_order(batch.sampled_chunks):
        spans.append((chunk, slice(row, row + chunk.num_tokens)))
        row += chunk.num_tokens
    if row != states.shape[0]:
        raise RuntimeError(f"{row} rows of sampling chunks in a {states.shape[0]}-token step")
    return hidden, states, spans


def served_tables(runner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The served model's embedding table ``[vocab, hidden]`` and final norm weight ``[hidden]``
    (float32 copies: the head's lm_head and norm start there)."""
    with torch.inference_mode():
        embed = runner.model.embed(torch.arange(runner.spec.vocab_size)).float().clone()
        return embed, runner.model.norm.weight.detach().float().clone()


def _cut_at_eos(answer: list[int], eos: set[int]) -> list[int]:
    """``answer`` up to and including its first end-of-sequence token."""
    for j, tok in enumerate(answer):
        if tok in eos:
            return answer[: j + 1]
    return answer


def jacobi_generate(model_dir: Path, prompts: list[list[int]], drafts: list[list[int]], aux_ids: tuple[int, ...],
                    iters: int, max_answer: int, log: object = print) -> JacobiData:  # fmt: skip
    """Examples from ``iters`` Jacobi iterations over ``prompts`` + ``drafts`` (see the module
    docstring); answers at most ``max_answer`` tokens."""
    cfg = json.loads((model_dir / "config.json").read_text())
    eos_cfg = cfg.get("eos_token_id")
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg] if eos_cfg is not None else [])
    longest = min(2048, cfg.get("max_position_embeddings", 2048))
    answers = [d[:max_answer] for d in drafts]
    keep = [i for i, p in enumerate(prompts) if len(p) + max_answer + 1 <= longest and answers[i]]
    prompts, answers = [prompts[i] for i in keep], [answers[i] for i in keep]
    pre = _Prefiller(model_dir, aux_ids, longest)
    changed: list[float] = []
    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    for it in range(iters + 1):  # the last pass only catches the final sequences' states
        caught = pre.run([p + a for p, a in zip(prompts, answers, strict=True)])
        if it == iters:
            break
        moved = total = 0
        for i, (prompt, (_, greedy)) in enumerate(zip(prompts, caught, strict=True)):
            nxt = greedy[len(prompt) - 1 :].tolist()  # the model's token after prompt + answer[:j], j = 0..len
            new = _cut_at_eos(nxt[: max(len(answers[i]), 1) + 1][:max_answer], eos)
            moved += sum(a != b for a, b in zip(new, answers[i], strict=False)) + abs(len(new) - len(answers[i]))
            total += len(new)
            answers[i] = new
        changed.append(moved / max(total, 1))
        log(f"jacobi iteration {it + 1}/{iters}: {100 * changed[-1]:.1f}% of answer tokens changed")  # type: ignore[operator]
    embed, final_norm = pre.close()
    examples: list[Example] = []
    on = total = 0
    for prompt, answer, (states, greedy) in zip(prompts, answers, caught, strict=True):
        seq = torch.tensor(prompt + answer)
        n = len(seq)
        if len(answer) < 2:
            continue
        mask = torch.arange(n) >= len(prompt) - 1  # labels that are answer positions (or the one after)
        if answer[-1] in eos:
            mask[-1] = False  # nothing follows the end of the answer
        hits = (seq[len(prompt) :] == greedy[len(prompt) - 1 : n - 1]).tolist()
        on += next((j for j, h in enumerate(hits) if not h), len(hits))
        total += len(hits)
        examples.append(Example(states, seq, greedy, mask))
    return JacobiData(examples, embed, final_norm, changed, on / max(total, 1))
