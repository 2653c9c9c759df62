"""lm-eval's ``local-completions`` against a served model vs lm-eval's own ``hf`` backend.

Two local tasks (no download; the data are written next to the task files): a multiple-choice
question per country ("What is the capital of X?", four capitals to choose from), scored by
loglikelihood, and the same questions as generate-until (greedy, up to 8 tokens, stops at "."
or a newline), scored by exact match. lm-eval's CLI (``lm_eval run``, from its own
environment) evaluates both with ``hf`` (transformers on the model directory, float32, CPU)
and with ``local-completions`` against ``/v1/completions`` (echo + logprobs, token-id prompts:
``tokenized_requests=True`` with the model's own tokenizer). The samples it logs give every
per-choice loglikelihood and every generation, so the two backends are compared item by item.

Knows nothing about the server's lifetime or the environments; the orchestration is
:mod:`bench.compat.run`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MC_TASK = "inflight_compat_capitals_mc"
GEN_TASK = "inflight_compat_capitals_gen"
TOLERANCE = 1e-4  # largest acceptable |loglikelihood difference|, as in lm_eval_parity
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("Italy", "Rome"),
    ("Spain", "Madrid"), ("the United Kingdom", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("India", "New Delhi"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Kenya", "Nairobi"),
    ("Argentina", "Buenos Aires"), ("Turkey", "Ankara"), ("Thailand", "Bangkok"), ("South Korea", "Seoul"),
    ("Peru", "Lima"), ("Cuba", "Havana"), ("Finland", "Helsinki"), ("Hungary", "Budapest"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"),
)


@dataclass(frozen=True, slots=True)
class LmEvalRun:
    """What one backend produced: the two scores and every item behind them."""

    acc: float
    exact_match: float
    loglikelihoods: dict[tuple[int, int], float]  # (doc_id, choice) -> loglikelihood
    generations: dict[int, str]  # doc_id -> generated text


@dataclass(frozen=True, slots=True)
class LmEvalComparison:
    """``hf`` vs ``local-completions`` on the same tasks."""

    num_docs: int
    num_loglikelihoods: int
    acc_hf: float
    acc_ours: float
    max_loglikelihood_diff: float
    exact_match_hf: float
    exact_match_ours: float
    same_generations: int

    @property
    def loglikelihood_ok(self) -> bool:
        return self.acc_hf == self.acc_ours and self.max_loglikelihood_diff <= TOLERANCE

    @property
    def generate_ok(self) -> bool:
        return self.exact_match_hf == self.exact_match_ours and self.same_generations == self.num_docs


def write_tasks(folder: Path, num_docs: int, seed: int = 0) -> Path:
    """Both task YAMLs and their data under ``folder`` (lm-eval's ``--include_path``)."""
    if not 1 <= num_docs <= len(CAPITALS):
        raise ValueError(f"num_docs must be between 1 and {len(CAPITALS)}, not {num_docs}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    capitals = [c for _, c in CAPITALS]
    mc, gen = [], []
    for country, capital in CAPITALS[:num_docs]:
        choices = rng.sample([c for c in capitals if c != capital], 3)
        answer = rng.randrange(4)
        choices.insert(answer, capital)
        mc.append({"question": f"Question: What is the capital of {country}?\nAnswer:", "choices": choices,
                   "answer": answer})
        gen.append({"prompt": f"Q: What is the capital of {country}?\nA: The capital of {country} is",
                    "capital": capital})
    for name, docs in ((MC_TASK, mc), (GEN_TASK, gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = {name: json.dumps(str(folder / f"{name}.jsonl")) for name in (MC_TASK, GEN_TASK)}
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n" + common.format(data[MC_TASK]) +
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\ntarget_delimiter: \" \"\nmetric_list:\n  - metric: acc\n")
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n" + common.format(data[GEN_TASK]) +
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{capital}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "  temperature: 0.0\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n    ignore_case: true\n    ignore_punctuation: true\n"
        "    regexes_to_ignore: [\" \"]\n")
    return folder


def _common_args(task_dir: Path, out_dir: Path) -> list[str]:
    return ["--tasks", f"{MC_TASK},{GEN_TASK}", "--include_path", str(task_dir), "--batch_size", "1",
            "--output_path", str(out_dir), "--log_samples", "--seed", "0"]


def hf_command(lm_eval: str, model_dir: Path, task_dir: Path, out_dir: Path) -> list[str]:
    """lm-eval's own ``hf`` backend on the model directory (float32 on the CPU)."""
    from inflight.runtime.model.float_export import float_checkpoint_dir

    model_dir = float_checkpoint_dir(model_dir)  # transformers needs every tensor in safetensors
    return [lm_eval, "run", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32",
            "--device", "cpu", *_common_args(task_dir, out_dir)]


def local_completions_command(lm_eval: str, model: str, base_url: str, model_dir: Path, task_dir: Path,
                              out_dir: Path) -> list[str]:
    """``local-completions`` against ``base_url``'s ``/v1/completions`` serving ``model``."""
    args = (f"model={model},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},tokenized_requests=True,num_concurrent=4,max_retries=1")
    return [lm_eval, "run", "--model", "local-completions", "--model_args", args, *_common_args(task_dir, out_dir)]


def _newest(out_dir: Path, pattern: str) -> Path:
    found = sorted(out_dir.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"lm-eval wrote no {pattern} under {out_dir}")
    return found[-1]


def _samples(out_dir: Path, task: str) -> list[dict[str, Any]]:
    path = _newest(out_dir, f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(out_dir: Path) -> LmEvalRun:
    """The scores and items of one ``lm_eval run --output_path out_dir --log_samples``."""
    results = json.loads(_newest(out_dir, "results_*.json").read_text())["results"]
    loglikelihoods = {(s["doc_id"], j): float(resp[0][0])
                      for s in _samples(out_dir, MC_TASK) for j, resp in enumerate(s["resps"])}
    generations = {s["doc_id"]: str(s["resps"][0][0]) for s in _samples(out_dir, GEN_TASK)}
    return LmEvalRun(float(results[MC_TASK]["acc,none"]), float(results[GEN_TASK]["exact_match,none"]),
                     loglikelihoods, generations)


def compare(hf: LmEvalRun, ours: LmEvalRun) -> LmEvalComparison:
    """Item by item; a loglikelihood missing on either side makes the difference infinite."""
    if hf.loglikelihoods.keys() == ours.loglikelihoods.keys() and hf.loglikelihoods:
        diff = max(abs(hf.loglikelihoods[k] - ours.loglikelihoods[k]) for k in hf.loglikelihoods)
    else:
        diff = float("inf")
    same = sum(1 for k, text in hf.generations.items() if ours.generations.get(k) == text)
    return LmEvalComparison(len(hf.generations), len(hf.loglikelihoods), hf.acc, ours.acc, diff,
                            hf.exact_match, ours.exact_match, same)
