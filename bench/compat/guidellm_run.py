"""A short guidellm run against a served model, and its headline figures.

guidellm (vLLM's load generator) sends synthetic chat requests of a fixed prompt and output
length at a fixed concurrency until a request count is reached, tokenizing with the model's own
tokenizer directory, and writes its report as JSON. Only the headline figures are read back:
requests done and failed, requests/s, output tokens/s, TTFT and ITL medians, latency median.

Knows nothing about the server's lifetime or the environments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class GuidellmLoad:
    """The load: ``num_requests`` at ``concurrency``, each ``prompt_tokens`` in, ``output_tokens`` out."""

    num_requests: int = 32
    concurrency: int = 4
    prompt_tokens: int = 64
    output_tokens: int = 32


@dataclass(frozen=True, slots=True)
class GuidellmHeadline:
    num_ok: int
    num_errored: int
    num_incomplete: int
    requests_per_s: float
    output_tok_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    latency_p50_s: float

    @property
    def ok(self) -> bool:
        return self.num_ok > 0 and self.num_errored == 0 and self.num_incomplete == 0

    def describe(self, load: GuidellmLoad) -> str:
        return (f"{self.num_ok}/{load.num_requests} ok, {self.num_errored} errors; {self.requests_per_s:.2f} req/s, "
                f"{self.output_tok_per_s:.0f} output tok/s, TTFT p50 {self.ttft_p50_ms:.0f} ms, "
                f"ITL p50 {self.itl_p50_ms:.1f} ms, latency p50 {self.latency_p50_s:.2f} s")


def command(guidellm: str, base_url: str, model: str, tokenizer_dir: Path, out_json: Path,
            load: GuidellmLoad) -> list[str]:
    """``guidellm run`` (0.8's ``kind=...`` options) for ``load`` against ``base_url``."""
    return [guidellm, "run",
            "--backend", f"kind=openai_http,target={base_url},model={model}",
            "--profile", f"kind=concurrent,streams={load.concurrency}",
            "--constraint", f"kind=max_requests,count={load.num_requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={out_json}",
            "--disable-progress"]


def headline(report: dict[str, Any]) -> GuidellmHeadline:
    """The first benchmark's headline figures from guidellm's JSON report."""
    metrics = report["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def ok(name: str, stat: str = "median") -> float:
        return float(metrics[name]["successful"][stat])

    return GuidellmHeadline(
        num_ok=int(totals["successful"]), num_errored=int(totals["errored"]),
        num_incomplete=int(totals["incomplete"]), requests_per_s=ok("requests_per_second", "mean"),
        output_tok_per_s=ok("output_tokens_per_second", "mean"), ttft_p50_ms=ok("time_to_first_token_ms"),
        itl_p50_ms=ok("inter_token_latency_ms"), latency_p50_s=ok("request_latency"))
