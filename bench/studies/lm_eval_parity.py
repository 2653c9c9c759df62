"""lm-evaluation-harness parity: ``local-completions`` against our server vs lm-eval's own ``hf``.

``python -m bench.studies.lm_eval_parity [--model DIR | --arch llama --size small] [--num-docs 40]``

Needs ``lm-eval`` importable (it is not a dependency of this project: install it in a separate
environment that also sees this one, e.g. a venv with a ``.pth`` file pointing at ``.venv``'s
site-packages, so torch is not reinstalled). Writes a small local multiple-choice task (no
download), evaluates it with the ``hf`` backend (transformers on the same model directory) and
with ``local-completions`` against an in-process ``inflight`` server (echo + logprobs, token-id
prompts), then compares accuracy and every per-choice loglikelihood. Target: equal accuracy,
loglikelihoods within 1e-4. Prints the figures and the time each backend took.

Both backends get ``add_bos_token=True``: left unset, lm-eval's ``hf`` backend lets the
tokenizer add BOS while its API backends send no BOS, so the two would score different token
sequences (differences of several nats that are lm-eval's, not the server's).

Measured on the 2-core development machine (llama ``small`` demo model, 25 questions, 100
loglikelihoods): equal accuracy (0.16), largest loglikelihood difference 7.6e-6; ``hf`` took
116 s and ``local-completions`` 29 s (the machine was shared and loaded); 2.6 min in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOLERANCE = 1e-4
TASK = "inflight_parity_mc"
WORDS = ["red", "green", "blue", "cat", "dog", "house", "river", "stone", "tree", "light", "cloud", "fire"]


def write_task(folder: Path, num_docs: int, seed: int = 0) -> None:
    """A local multiple-choice task: a question and four one-to-three-word answers."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        choices = [" ".join(rng.sample(WORDS, rng.randint(1, 3))) for _ in range(4)]
        docs.append({"question": f"Question {i}: which of these goes with {rng.choice(WORDS)}?\nAnswer:",
                     "choices": choices, "answer": rng.randrange(4)})
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n")


def evaluate(model: str, model_args: str, task_dir: Path) -> tuple[dict[str, Any], float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    return out, time.perf_counter() - start


def loglikelihoods(out: dict[str, Any]) -> dict[tuple[int, int], float]:
    values = {}
    for sample in out["samples"][TASK]:
        for j, resp in enumerate(sample["resps"]):
            values[(sample["doc_id"], j)] = float(resp[0][0])
    return values


class _Server:
    """The real server on 127.0.0.1 in a background event-loop thread."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: Any = None

    def start(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(300)

    async def _start(self) -> str:
        from aiohttp import web

        from inflight.runtime.config import EngineConfig
        from inflight.runtime.core.engine import LLMEngine
        from inflight.runtime.server import ServerSettings, create_app
        from inflight.runtime.server.state import STATE

        config = EngineConfig(max_num_sequences=8, max_model_len=512, dtype="float32")
        app = create_app(ServerSettings(model_name="demo"), lambda: LLMEngine.from_model_dir(self.model_dir, config))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        await app[STATE].engine.wait_ready()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.lm_eval_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-docs", type=int, default=40)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from inflight.runtime.demo.model import make_demo_model

            model_dir = make_demo_model(tmp_path / "model", arch=args.arch, size=args.size)
        write_task(tmp_path, args.num_docs)
        from inflight.runtime.model.float_export import float_checkpoint_dir

        reference_dir = float_checkpoint_dir(model_dir)  # transformers needs every tensor in safetensors
        hf, hf_s = evaluate("hf", f"pretrained={reference_dir},dtype=float32,device=cpu,add_bos_token=True", tmp_path)
        server = _Server(model_dir)
        url = server.start()
        try:
            ours, ours_s = evaluate(
                "local-completions",
                f"model=demo,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={model_dir},"
                "num_concurrent=4,max_retries=1,tokenized_requests=True,add_bos_token=True", tmp_path)
        finally:
            server.stop()
    want, got = loglikelihoods(hf), loglikelihoods(ours)
    diff = max(abs(want[k] - got[k]) for k in want) if want.keys() == got.keys() else float("inf")
    acc = (hf["results"][TASK]["acc,none"], ours["results"][TASK]["acc,none"])
    ok = diff <= TOLERANCE and acc[0] == acc[1]
    summary = {"num_docs": args.num_docs, "num_loglikelihoods": len(want), "acc_hf": acc[0],
               "acc_local_completions": acc[1], "max_abs_loglikelihood_diff": diff, "hf_s": hf_s,
               "local_completions_s": ours_s, "meets_target": ok}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
