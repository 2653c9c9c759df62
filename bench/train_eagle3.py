"""``python -m bench.train_eagle3``: train an EAGLE-3 head for SmolLM2-135M-Instruct on this CPU
from the model's own greedy outputs, then measure it against no speculation, side by side.

1. **Data** (:mod:`bench.eagle3_data`): ``--num-prompts`` input-grounded chat prompts (summarise,
   repeat, rewrite, list, fix, rename, comment a given text) over passages of standard-library
   docstrings, license texts and package descriptions in the environment, and short
   standard-library functions, seeded. The served model (this engine, its Q4_1 tensors packed as
   ``inflight serve`` serves them) answers them greedily, batched; the runner's execute hook
   catches the hidden states entering the head's three aux layers at every position it runs, so
   the head learns from exactly the states it will be served (no second forward). Labels: the
   next token of the prompt + answer; the loss counts answer tokens only (``--data-cache`` keeps
   all of it for a rerun). ``--data prefill`` (:mod:`bench.eagle3_jacobi`) makes the data from
   prefills instead: each prompt followed by its own passage as the answer, prefilled whole, every
   position labelled with the model's greedy next token (``--jacobi-iters`` moves the answer
   toward the model's own first); a chained pass learns only where the tokens it is fed are the
   model's choices (:func:`bench.eagle3_fit.chain_ok`).
2. **Training**: :mod:`bench.eagle3_fit` (seeded, ``--steps`` chained passes unrolled, the loss on
   the draft vocabulary: the ``--draft-vocab`` most frequent answer tokens, mapped by ``d2t``),
   ``lm_head`` and ``norm`` starting from the served model's own rows and final norm (``lm_head``
   kept fixed unless ``--train-lm-head``); 10% of the sequences are kept out for an offline check
   (top-1 agreement of each pass on training and unseen sequences); saved to ``--out`` in the
   published layout (config.json + model.safetensors).
3. **Measurement**, one interleaved run on held-out prompts from other sources (passages of this
   repository's docs/ and :data:`bench.studies.speculative.GROUNDED`): draft acceptance per
   position, batch-1 TPOT and batch-``--batch`` throughput, with and without ``{"method":
   "eagle3", ...}`` (and ``--ngram``: n-gram speculation as a reference); ``--results`` writes the
   table and figures.

``--tiny`` runs every stage in seconds on a random demo model (the smoke test's mode). A
benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.eagle3_data import held_out_prompts, training_pairs
from bench.eagle3_fit import Example, HeadShape, TrainHead, agreement, save_head, train
from bench.eagle3_jacobi import forward_catching, jacobi_generate, served_tables
from bench.studies.spec_draft import _tpot_ms
from bench.studies.speculative import GROUNDED
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.batch_inputs import BatchInputs

TEXTS = (
    "The river rose for three days before the town council agreed to open the old flood gates. By then the "
    "bakery on Mill Street had lost its ovens, and the school had moved its classes into the church hall.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Our quarterly report shows revenue up 12 percent, costs flat, and two new offices opening in Lisbon and "
    "Osaka. Hiring will slow in the second half while the new billing system is rolled out.",
    "To reset the router, hold the small button on the back for ten seconds until the light blinks orange, "
    "then wait two minutes and connect again using the password printed on the label.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items"
    ".append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "Maria planted tomatoes, basil and peppers in April. The tomatoes grew fastest, the basil was eaten by "
    "snails, and the peppers only turned red in September after a warm week.",
    "The meeting is moved from Tuesday at 10:00 to Thursday at 14:30 in room 4B. Please bring the draft "
    "budget and the list of open questions from the last review.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, and it is the source of almost all the oxygen we breathe.",
    "SELECT name, email FROM users WHERE active = 1 AND created_at > '2024-01-01' ORDER BY name;",
    "The train to Oslo leaves at 07:15 from platform 3. Tickets bought online must be shown on a phone or "
    "printed; the café car is closed on weekends.",
    'def greet(name, excited=False):\n    message = f"Hello, {name}"\n    if excited:\n        message += "!"\n'
    "    return message\n",
    "Cats sleep between twelve and sixteen hours a day. Kittens and old cats sleep even more, and most of "
    "that sleep is light, so they can wake quickly.",
    "Shipping is free for orders over 50 euros. Returns are accepted within 30 days if the item is unused "
    "and in its original box; refunds take five working days.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
)
TEMPLATES = (
    "Summarise this text in one sentence:\n\n{t}",
    "Repeat the following text exactly:\n\n{t}",
    "Rewrite this text in simpler words:\n\n{t}",
    "List the key facts of this text as bullet points:\n\n{t}",
    "Copy this text and fix any mistakes:\n\n{t}",
    "Here is a text. Repeat it, then say what it is about:\n\n{t}",
    "Rewrite the text below in the past tense:\n\n{t}",
    "{t}\n\nRepeat the text above word for word.",
)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True, slots=True)
class Served:
    """What training reads from the served model: the examples, its embedding table ``[vocab,
    hidden]`` and its final norm's weight ``[hidden]`` (the head's lm_head and norm start there)."""

    examples: list[Example]
    embed: torch.Tensor
    final_norm: torch.Tensor


def generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, aux_ids: tuple[int, ...]) -> Served:
    """The served model's greedy answers (the engine batching them), with the hidden states
    entering layers ``aux_ids`` at every position it ran, caught in the runner's execute hook
    (prompts whole, never chunked, so every chunk of a step samples and rows map to chunks in
    packed order). Position ``i`` of an example is labelled with token ``i + 1``; only answer
    tokens count (``mask``), the prompt's positions give the head's attention its keys."""
    longest = min(2048, json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048))
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=4096, enable_chunked_context=False,
                                                              max_model_len=longest, enable_prefix_caching=False))
    runner = engine.runner
    caught: dict[str, list[tuple[int, torch.Tensor]]] = {str(i): [] for i in range(len(prompts))}

    def hook(batch: BatchInputs) -> torch.Tensor:
        hidden, states, spans = forward_catching(runner, batch, aux_ids)
        for chunk, rows in spans:
            caught[chunk.req_id].append((chunk.start, states[rows].clone()))
        return runner.model.compute_logits(hidden[batch.sample_indices], runner.ops)

    runner.execute_hook = hook
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    answers: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers[out.req_id].extend(out.new_token_ids)
    runner.execute_hook = None
    embed, final_norm = served_tables(runner)
    engine.close()
    examples = []
    for i, prompt in enumerate(prompts):
        parts = sorted(caught[str(i)], key=lambda part: part[0])
        aux = torch.cat([t for _, t in parts])  # positions 0 .. len(prompt) + len(answer) - 2
        seq = prompt + answers[str(i)]
        n = aux.shape[0]
        if n != len(seq) - 1 or len(answers[str(i)]) < 2:
            continue
        tokens = torch.tensor(seq[:n])
        labels = torch.tensor(seq[1 : n + 1])
        mask = torch.arange(n) >= len(prompt) - 1  # labels that are answer tokens
        examples.append(Example(aux, tokens, labels, mask))
    return Served(examples, embed, final_norm)


def _throughput(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second for ``prompts`` submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", ids, params)
    start, count = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        count += sum(len(out.new_token_ids) for out in engine.step())
    return count / (time.perf_counter() - start)


def measure(model_dir: Path, head: Path, k: int, prompts: list[list[int]], batch: int, reps: int,
            max_tokens: int, with_ngram: bool = False) -> dict[str, Any]:  # fmt: skip
    """Batch-1 TPOT and batch-``batch`` throughput of each system (no speculation, the head, and
    with ``with_ngram`` n-gram speculation as a reference), repetitions interleaved."""
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    systems = [("none", None), (f"eagle3 k={k}", spec)] + ([(f"ngram k={k}", ngram)] if with_ngram else [])
    engines = {name: LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=4096, speculative_config=cfg))
               for name, cfg in systems}  # fmt: skip
    for engine in engines.values():
        engine.warmup()
    names = list(engines)
    tpots: dict[str, list[float]] = {n: [] for n in names}
    tps: dict[str, list[float]] = {n: [] for n in names}
    burst = [prompts[i % len(prompts)] for i in range(batch)]
    for rep in range(reps):
        for i, prompt in enumerate(prompts):  # each prompt on every system in turn: paired under drifting load
            turn = (rep + i) % len(names)
            for name in names[turn:] + names[:turn]:
                tpots[name].append(_tpot_ms(engines[name], prompt, max_tokens))
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            tps[name].append(_throughput(engines[name], burst, max_tokens))
        print(f"rep {rep}: " + ", ".join(f"{n}: TPOT {statistics.median(tpots[n]):.1f} ms, "
                                         f"{statistics.median(tps[n]):.0f} tok/s" for n in names), flush=True)  # fmt: skip
    result = {}
    for name in names:
        stats = engines[name].stats()
        drafted = stats.spec_num_draft_tokens
        per_pos = list(stats.spec_accepted_per_position)
        steps = drafted / k if drafted else 0
        result[name] = {"tpot_p50_ms": statistics.median(tpots[name]), "tps_p50": statistics.median(tps[name]),
                        "speedup_paired": statistics.median(b / t for b, t in zip(tpots["none"], tpots[name], strict=True)),
                        "tps_ratio_paired": statistics.median(t / b for b, t in zip(tps["none"], tps[name], strict=True)),
                        "tpots_ms": tpots[name], "tps": tps[name],
                        "acceptance": stats.spec_num_accepted_tokens / drafted if drafted else None,
                        "acceptance_per_position": [a / steps for a in per_pos] if steps else []}  # fmt: skip
        engines[name].close()
    return result


def table(res: dict[str, Any], batch: int) -> str:
    base = res["none"]
    lines = [f"| system | batch-1 TPOT p50 ms | speed-up (paired) | batch-{batch} tok/s | ratio (paired) | acceptance "
             "| per position |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        pos = " / ".join(f"{100 * a:.0f}%" for a in r["acceptance_per_position"])
        lines.append(
            f"| {name} | {r['tpot_p50_ms']:.1f} | {base['tpot_p50_ms'] / r['tpot_p50_ms']:.2f}x "
            f"({r['speedup_paired']:.2f}x) | {r['tps_p50']:.0f} | {r['tps_p50'] / base['tps_p50']:.2f}x "
            f"({r['tps_ratio_paired']:.2f}x) | {acc} | {pos} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train_eagle3", description=__doc__)
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--out", type=Path, default=Path("models/eagle3-smollm2-135m"), help="the head's directory")
    p.add_argument("--tiny", action="store_true", help="a random 4-layer demo model, seconds (smoke test)")
    p.add_argument("--num-prompts", type=int, default=256, help="training prompts (not with --tiny)")
    p.add_argument("--held-out", type=int, default=6, help="held-out docs/ prompts measured (beside GROUNDED)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="chained passes unrolled in training")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the head's lm_head too (else it keeps the target's rows; --tiny trains it)")
    p.add_argument("--lr", type=float, default=None, help="default 2e-3 (3e-3 with --tiny)")
    p.add_argument("--gen-tokens", type=int, default=80, help="answer length of the training data")
    p.add_argument("--data", choices=("decode", "prefill"), default="decode",
                   help="decode: the engine answers each prompt token by token; prefill: each prompt with its "
                        "passage as the answer, prefilled whole, labelled with the model's greedy next token at "
                        "every position (bench.eagle3_jacobi; far cheaper per token)")
    p.add_argument("--jacobi-iters", type=int, default=0,
                   help="with --data prefill: Jacobi iterations moving the answer toward the greedy one")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast (faster on AVX-512 BF16)")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens measured")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-measure", action="store_true")
    p.add_argument("--measure-only", action="store_true", help="measure the head already in --out (no training)")
    p.add_argument("--ngram", action="store_true", help="measure n-gram speculation beside it (a reference)")
    p.add_argument("--eval-on-train", action="store_true", help="measure on the training prompts (a fit check)")
    p.add_argument("--results", type=Path, default=None, help="also write the table and figures here (.md, .json)")
    p.add_argument("--data-cache", type=Path, default=None,
                   help="keep the generated data here (torch.save) and reuse it when its arguments match")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.tiny:
        from inflight.runtime.demo.model import make_demo_model

        model_dir = make_demo_model(args.out.parent / "tiny-target", "llama", "tiny", eos=False,
                                    config_overrides={"num_hidden_layers": 4})  # fmt: skip
        train_texts = [t.format(t=x) for x in TEXTS[:2] for t in TEMPLATES[:2]]
        passages = [x for x in TEXTS[:2] for _ in TEMPLATES[:2]]
        eval_texts = [t.format(t=x) for x in TEXTS[-1:] for t in TEMPLATES[:2]]
    else:
        from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

        model_dir = Path(ensure_smollm2(args.models_dir))
        pairs = training_pairs(args.num_prompts, args.seed)
        train_texts, passages = [p for p, _ in pairs], [t for _, t in pairs]
        eval_texts = held_out_prompts(Path(__file__).resolve().parent.parent / "docs", args.held_out, args.seed)
        eval_texts += list(GROUNDED)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    aux_ids = (2, layers // 2, layers - 3) if layers >= 6 else (0, layers // 2, layers - 1)
    prompts = [chat_ids(tokenizer, text) for text in train_texts]
    if args.measure_only:
        held = [chat_ids(tokenizer, text) for text in eval_texts]
        res = measure(model_dir, args.out, args.k, held, args.batch, args.reps, args.max_tokens, args.ngram)
        done = args.out / "training.json"
        return _report(args, model_dir, held, res, json.loads(done.read_text()) if done.exists() else {})
    t0 = time.perf_counter()
    key = {"model": str(model_dir), "prompts": prompts, "gen_tokens": args.gen_tokens, "aux_ids": aux_ids,
           "data": args.data, "jacobi_iters": args.jacobi_iters}  # fmt: skip
    cached = torch.load(args.data_cache, weights_only=False) if args.data_cache and args.data_cache.exists() else None
    data_facts: dict[str, Any] = {"data": args.data}
    if cached is not None and cached["key"] == key:
        served, data_facts = cached["served"], cached.get("facts", data_facts)
    elif args.data == "prefill":
        drafts = [tokenizer.encode(t, add_special_tokens=False) for t in passages]
        got = jacobi_generate(model_dir, prompts, drafts, aux_ids, args.jacobi_iters, args.gen_tokens,
                              log=partial(print, flush=True))  # fmt: skip
        served = Served(got.examples, got.embed, got.final_norm)
        data_facts |= {"jacobi_iters": args.jacobi_iters, "jacobi_changed": got.changed,
                       "greedy_prefix_share": got.on_path}  # fmt: skip
    else:
        served = generate(model_dir, prompts, args.gen_tokens, aux_ids)
        if args.data_cache:
            args.data_cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "served": served, "facts": data_facts}, args.data_cache)
    t1 = time.perf_counter()
    num_val = len(served.examples) // 10  # kept out of training: the offline agreement's check
    examples, val = served.examples[num_val:], served.examples[:num_val]
    vocab = cfg["vocab_size"]
    answer_labels = torch.cat([e.labels[e.mask] for e in examples])
    counts = torch.bincount(answer_labels, minlength=vocab)
    draft_vocab = min(args.draft_vocab, vocab)
    draft_ids = torch.sort(torch.topk(counts + torch.arange(vocab).flip(0) * 1e-9, draft_vocab).indices).values
    draft_of = torch.full((vocab,), -1, dtype=torch.int64)
    draft_of[draft_ids] = torch.arange(draft_vocab)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shape = HeadShape(cfg["hidden_size"], heads, kv_heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      cfg["intermediate_size"], vocab, draft_vocab, cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0))  # fmt: skip
    head = TrainHead(shape)
    head.start_from_target(served.embed[draft_ids], served.final_norm, train_lm_head=args.tiny or args.train_lm_head)
    covered = float((draft_of[answer_labels] >= 0).float().mean())
    print(
        f"{len(examples)} sequences, {sum(len(e.tokens) for e in examples)} positions "
        f"({answer_labels.numel()} answer tokens); aux layers {aux_ids}; draft vocabulary {draft_vocab} covers "
        f"{100 * covered:.1f}% of answer tokens; head {sum(q.numel() for q in head.parameters()) / 1e6:.1f}M "
        f"parameters ({sum(q.numel() for q in head.parameters() if q.requires_grad) / 1e6:.1f}M trained)",
        flush=True,
    )
    lr = args.lr or (3e-3 if args.tiny else 2e-3)
    losses = train(head, served.embed, examples, draft_of, epochs=args.epochs, steps=args.steps, lr=lr, seed=args.seed,
                   bf16=args.bf16)  # fmt: skip
    t2 = time.perf_counter()
    fit = {"train": agreement(head, served.embed, examples[: max(1, num_val)], draft_of, args.steps),
           "held_out": agreement(head, served.embed, val, draft_of, args.steps) if val else []}  # fmt: skip
    save_head(head, args.out, draft_ids, aux_ids, cfg)
    print(f"saved {args.out} (data {t1 - t0:.0f} s, training {t2 - t1:.0f} s); offline top-1 agreement per pass: "
          + ", ".join(f"{name} {[round(a, 2) for a in acc]}" for name, acc in fit.items()), flush=True)
    training = {"losses": losses, "offline_agreement": fit, "data_seconds": t1 - t0, "train_seconds": t2 - t1,
                "num_sequences": len(examples), "epochs": args.epochs, "draft_vocab": draft_vocab,
                "draft_vocab_coverage": covered, "bf16": args.bf16, **data_facts}  # fmt: skip
    (args.out / "training.json").write_text(json.dumps(training, indent=2))
    if args.no_measure:
        return 0
    held = prompts if args.eval_on_train else [chat_ids(tokenizer, text) for text in eval_texts]
    res = measure(model_dir, args.out, args.k, held, args.batch, args.reps, args.max_tokens, args.ngram)
    return _report(args, model_dir, held, res, training)


def _report(args: argparse.Namespace, model_dir: Path, held: list[list[int]], res: dict[str, Any],
            training: dict[str, Any]) -> int:  # fmt: skip
    """Print the table and figures; write them beside the head (bench.json) and to ``--results``."""
    fit = training.get("offline_agreement", {})
    text = (
        f"# EAGLE-3 head trained here for {model_dir.name} (this CPU)\n\n{len(held)} held-out input-grounded "
        f"prompts, greedy, {args.max_tokens} output tokens, {args.reps} interleaved repetitions (medians; paired: "
        f"the median of per-prompt ratios, each prompt run on every system in turn). Training: "
        f"{training.get('num_sequences')} sequences, {training.get('epochs')} epochs, loss per epoch "
        f"{[round(x, 2) for x in training.get('losses', [])]} (data {training.get('data_seconds', 0):.0f} s, "
        f"training {training.get('train_seconds', 0):.0f} s); offline top-1 agreement of each pass on training "
        f"sequences / unseen ones of the training sources: {fit.get('train')} / {fit.get('held_out')}."
        f"\n\n{table(res, args.batch)}\n"
    )
    print("\n" + text)
    figures = {**training, "results": res}
    (args.out / "bench.json").write_text(json.dumps(figures, indent=2))
    if args.results is not None:
        args.results.with_suffix(".md").write_text(text)
        args.results.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
