"""Helpers for the real-model tests: a real ``inflight serve`` process and chat prompts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0

# Short questions SmolLM2-135M-Instruct answers correctly under greedy decoding, with a word
# the answer must contain (checked case-insensitively).
FACTS = (
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What is 2 + 2?", "4"),
    ("What is the opposite of hot?", "cold"),
)

# Chat prompts for the token-exact comparison: varied lengths and topics.
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "How do I reverse a list in Python?",
    "What is the boiling point of water?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is photosynthesis?",
    "Suggest a name for a pet goldfish.",
    "Who was the first person to walk on the moon?",
    "What is the difference between a virus and a bacterium?",
)


def chat_ids(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    """The chat-templated prompt ids for one user question (with the generation prompt)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, through EOS. Prompts of one length decode as
    one batch: no padding, so a row's attention is what it is alone (only the matmuls' row
    count differs), and SmolLM2's 18 chat prompts take 10 ``generate`` calls instead of 18."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    outs: list[list[int]] = [[] for _ in prompts]
    for rows in by_length.values():
        batch = torch.tensor([prompts[i] for i in rows])
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        for i, tokens in zip(rows, out[:, batch.shape[1]:].tolist(), strict=True):
            end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
            outs[i] = tokens[:end]  # a row done before the others is padded after its EOS
    return outs


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class ServerProcess:
    """``python -m inflight.runtime serve ARGS --port 0`` with its log in a temp file."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self._log = tempfile.NamedTemporaryFile(prefix="inflight-realmodel-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "inflight.runtime", "serve", *self.args, "--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if match and not self.url:
                self.url = f"http://127.0.0.1:{match.group(1)}"
            if "ready: model" in self.log():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
