"""``python -m bench.train_eagle3``: train an EAGLE-3 head for SmolLM2-135M-Instruct on this CPU
from the model's own greedy outputs, then measure it against no speculation, side by side.

1. **Data**: input-grounded chat prompts (summarise, repeat, edit, translate-to-list a given
   text), made deterministically from the source texts below crossed with instruction templates;
   the served model (this engine, its Q4_1 tensors packed as ``inflight serve`` serves them)
   answers each greedily.
2. **Features**: transformers' float32 forward of each prompt + answer gives the hidden states
   entering the head's three aux layers and the model's greedy next token at every position
   (the labels; the draft vocabulary is the ``--draft-vocab`` most frequent of them, mapped by
   ``d2t``).
3. **Training**: :mod:`bench.eagle3_fit` (seeded, ``--steps`` chained passes unrolled), saved to
   ``--out`` in the published layout (config.json + model.safetensors).
4. **Measurement**, one interleaved run on held-out prompts (other texts than the training ones,
   and :data:`bench.studies.speculative.GROUNDED`): draft acceptance per position, batch-1 TPOT
   and batch-``--batch`` throughput, with and without ``{"method": "eagle3", ...}``.

``--tiny`` runs every stage in seconds on a random demo model (the smoke test's mode). A
benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.eagle3_fit import Example, HeadShape, TrainHead, save_head, train
from bench.studies.spec_draft import _tpot_ms
from bench.studies.speculative import GROUNDED
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

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
HELD_OUT = 4  # the last texts are kept for the measurement
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


def generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The served model's greedy answers (the engine batching them)."""
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=2048))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.req_id].extend(out.new_token_ids)
    engine.close()
    return [outs[str(i)] for i in range(len(prompts))]


def features(model_dir: Path, seqs: list[list[int]], aux_ids: tuple[int, ...]) -> tuple[list[Example], torch.Tensor]:
    """Aux states and greedy labels of each sequence (transformers, float32), and the embeddings."""
    from transformers import AutoModelForCausalLM

    gguf = model_dir / "source.gguf"  # a converted GGUF model: its quantized tensors live there
    extra = {"gguf_file": gguf.resolve().name} if gguf.exists() else {}
    where = gguf.resolve().parent if gguf.exists() else model_dir
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32, **extra).eval()
    examples = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            out = model(ids, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i][0] for i in aux_ids], -1)  # entering layer i
            examples.append(
                Example(aux.clone(), ids[0], out.logits[0].argmax(-1), torch.ones(len(seq), dtype=torch.bool))
            )
    return examples, model.get_input_embeddings().weight.detach().clone()


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
            max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Batch-1 TPOT and batch-``batch`` throughput of both systems, repetitions interleaved."""
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
    engines = {name: LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=4096, speculative_config=cfg))
               for name, cfg in (("none", None), (f"eagle3 k={k}", spec))}  # fmt: skip
    for engine in engines.values():
        engine.warmup()
    names = list(engines)
    tpots: dict[str, list[float]] = {n: [] for n in names}
    tps: dict[str, list[float]] = {n: [] for n in names}
    burst = [prompts[i % len(prompts)] for i in range(batch)]
    for rep in range(reps):
        for name in names[rep % 2 :] + names[: rep % 2]:
            tpots[name] += [_tpot_ms(engines[name], p, max_tokens) for p in prompts]
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
                        "acceptance": stats.spec_num_accepted_tokens / drafted if drafted else None,
                        "acceptance_per_position": [a / steps for a in per_pos] if steps else []}  # fmt: skip
        engines[name].close()
    return result


def table(res: dict[str, Any], batch: int) -> str:
    base = res["none"]
    lines = [f"| system | batch-1 TPOT p50 ms | speed-up | batch-{batch} tok/s | ratio | acceptance | per position |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        pos = " / ".join(f"{100 * a:.0f}%" for a in r["acceptance_per_position"])
        lines.append(
            f"| {name} | {r['tpot_p50_ms']:.1f} | {base['tpot_p50_ms'] / r['tpot_p50_ms']:.2f}x | "
            f"{r['tps_p50']:.0f} | {r['tps_p50'] / base['tps_p50']:.2f}x | {acc} | {pos} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train_eagle3", description=__doc__)
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--out", type=Path, default=Path("models/eagle3-smollm2-135m"), help="the head's directory")
    p.add_argument("--tiny", action="store_true", help="a random 4-layer demo model, seconds (smoke test)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="chained passes unrolled in training")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--gen-tokens", type=int, default=96, help="answer length of the training data")
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens measured")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-measure", action="store_true")
    p.add_argument("--eval-on-train", action="store_true", help="measure on the training prompts (a fit check)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.tiny:
        from inflight.runtime.demo.model import make_demo_model

        model_dir = make_demo_model(args.out.parent / "tiny-target", "llama", "tiny", eos=False,
                                    config_overrides={"num_hidden_layers": 4})  # fmt: skip
        train_texts, eval_texts, templates = TEXTS[:2], TEXTS[-1:], TEMPLATES[:2]
    else:
        from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

        model_dir = Path(ensure_smollm2(args.models_dir))
        train_texts, eval_texts, templates = TEXTS[:-HELD_OUT], TEXTS[-HELD_OUT:], TEMPLATES
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    aux_ids = (2, layers // 2, layers - 3) if layers >= 6 else (0, layers // 2, layers - 1)
    prompts = [chat_ids(tokenizer, t.format(t=x)) for x in train_texts for t in templates]
    t0 = time.perf_counter()
    answers = generate(model_dir, prompts, args.gen_tokens)
    t1 = time.perf_counter()
    examples, embed = features(model_dir, [q + a for q, a in zip(prompts, answers, strict=True)], aux_ids)
    t2 = time.perf_counter()
    vocab = cfg["vocab_size"]
    counts = torch.bincount(torch.cat([e.labels for e in examples]), minlength=vocab)
    draft_vocab = min(args.draft_vocab, vocab)
    draft_ids = torch.sort(torch.topk(counts + torch.arange(vocab).flip(0) * 1e-9, draft_vocab).indices).values
    draft_of = torch.full((vocab,), -1, dtype=torch.int64)
    draft_of[draft_ids] = torch.arange(draft_vocab)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shape = HeadShape(cfg["hidden_size"], heads, kv_heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      cfg["intermediate_size"], vocab, draft_vocab, cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0))  # fmt: skip
    head = TrainHead(shape)
    covered = float((draft_of[torch.cat([e.labels for e in examples])] >= 0).float().mean())
    print(
        f"{len(examples)} sequences, {sum(len(e.tokens) for e in examples)} tokens; aux layers {aux_ids}; "
        f"draft vocabulary {draft_vocab} covers {100 * covered:.1f}% of labels; "
        f"head {sum(q.numel() for q in head.parameters()) / 1e6:.1f}M parameters",
        flush=True,
    )
    losses = train(head, embed, examples, draft_of, epochs=args.epochs, steps=args.steps, lr=3e-3 if args.tiny else 1e-3,
                   seed=args.seed)  # fmt: skip
    t3 = time.perf_counter()
    save_head(head, args.out, draft_ids, aux_ids, cfg)
    print(f"saved {args.out} (data {t1 - t0:.0f} s, features {t2 - t1:.0f} s, training {t3 - t2:.0f} s)", flush=True)
    if args.no_measure:
        return 0
    held = [chat_ids(tokenizer, t.format(t=x)) for x in eval_texts for t in templates[::3]]
    if args.eval_on_train:
        held = prompts
    elif not args.tiny:
        held += [chat_ids(tokenizer, text) for text in GROUNDED]
    res = measure(model_dir, args.out, args.k, held, args.batch, args.reps, args.max_tokens)
    text = (
        f"# EAGLE-3 head trained here for {model_dir.name} (this CPU)\n\n{len(held)} held-out input-grounded "
        f"prompts, greedy, {args.max_tokens} output tokens, {args.reps} interleaved repetitions (medians); "
        f"training loss per epoch {[round(x, 2) for x in losses]}.\n\n{table(res, args.batch)}\n"
    )
    print("\n" + text)
    (args.out / "bench.json").write_text(json.dumps({"losses": losses, "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
