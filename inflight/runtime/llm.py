"""LLM: the offline API in the vocabulary vLLM users know.

    from inflight.runtime import LLM, SamplingParams
    llm = LLM("models/demo", max_num_sequences=16)
    outputs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].text, outputs[0].token_ids, outputs[0].finish_reason)

It adds every prompt to one engine and steps until all finish, so the prompts share batches
exactly as concurrent server requests would. A prompt may also be a dict as vLLM takes it,
``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, with an optional ``"cache_salt"``: only
prompts with the same salt share prefix-cache blocks. With ``tensor_parallel_size=N`` the engine
starts N-1 worker processes; ``close()`` (or a ``with`` block, or interpreter exit) stops them.
What the model cannot be served with across processes (a hybrid model's layers are not split) is
refused before any starts, with the message ``inflight serve``'s preflight gives.

Text takes the server's one path: the engine sends token ids only, and
:class:`~inflight.runtime.engine_core.output_text.OutputText` detokenizes them and ends a request
at its stop string (cut from the text), which is then aborted in the engine
(:func:`~inflight.runtime.engine_core.output_text.step_with_text`), as the front end does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.state_pool import hybrid_refusal
from inflight.runtime.engine_core.output_text import OutputText, step_with_text
from inflight.runtime.lora.types import LoRARequest
from inflight.runtime.model.gguf_source import resolve_model_dir
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.outputs import CompletionOutput, TokenLogprob
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.encoder_runner import is_encoder_dir

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Offline batch generation over one :class:`LLMEngine`."""

    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        model_dir = resolve_model_dir(model)  # a .gguf file converts once into a cached directory
        config = EngineConfig(**engine_config)
        _refuse_before_workers(model_dir, config)
        self._attach(LLMEngine.from_model_dir(model_dir, config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine already built (tests compare two engines this way)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._text = OutputText(self.tokenizer, engine.eos_token_ids)  # the one text path
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; results come back in prompt order. ``lora_request`` (vLLM's):
        one LoRA adapter for every prompt, or one (or None) per prompt; each is loaded on first use
        (``LLM(model, enable_lora=True)``)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts.")
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompt_list))
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts.")
        lora_names = [None if lr is None else self.engine.add_lora(lr.lora_name, lr.lora_path).name for lr in loras]
        req_ids, prompt_ids = [], []
        for prompt, p, lora_name in zip(prompt_list, param_list, lora_names, strict=True):
            req_id = f"offline-{self._counter}"
            self._counter += 1
            ids, cache_salt = self._parse_prompt(prompt)
            self.engine.add_request(req_id, ids, p, cache_salt=cache_salt, lora_name=lora_name)
            self._text.add(req_id, p)
            req_ids.append(req_id)
            prompt_ids.append(ids)
        return self._run(req_ids, prompt_ids)

    def _parse_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """A prompt's token ids and ``cache_salt`` (None unless a dict prompt carries one)."""
        if not isinstance(prompt, dict):
            return self.engine.encode_prompt(prompt), None
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a dict prompt needs exactly one of 'prompt' (text) and 'prompt_token_ids', and "
                             f"may add 'cache_salt' (got keys {sorted(prompt)}).")
        text_or_ids = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
        return self.engine.encode_prompt(text_or_ids), prompt.get("cache_salt")

    def _run(self, req_ids: list[str], prompt_ids: list[list[int]]) -> list[CompletionOutput]:
        tokens: dict[str, list[int]] = {r: [] for r in req_ids}
        texts: dict[str, list[str]] = {r: [] for r in req_ids}
        logprobs: dict[str, list[TokenLogprob]] = {r: [] for r in req_ids}
        done: dict[str, CompletionOutput] = {}
        while len(done) < len(req_ids):
            for out in step_with_text(self.engine, self._text):
                tokens[out.req_id].extend(out.new_token_ids)
                texts[out.req_id].append(out.new_text)
                if out.new_logprobs:
                    logprobs[out.req_id].extend(out.new_logprobs)
                if out.finished:
                    idx = req_ids.index(out.req_id)
                    done[out.req_id] = CompletionOutput(
                        req_id=out.req_id,
                        prompt_token_ids=prompt_ids[idx],
                        text="".join(texts[out.req_id]),
                        token_ids=tokens[out.req_id],
                        finish_reason=out.finish_reason or "stop",
                        logprobs=logprobs[out.req_id] or None,
                        num_cached_tokens=out.num_cached_tokens,
                    )
        return [done[r] for r in req_ids]


def _refuse_before_workers(model_dir: Path, config: EngineConfig) -> None:
    """``ValueError`` for a hybrid model under tensor or pipeline parallelism, from its config
    alone and before the engine starts its worker processes (which would each fail with a
    traceback of their own): the refusal ``inflight serve`` gives at preflight."""
    if config.tensor_parallel_size * config.pipeline_parallel_size <= 1 or config.device == "sim":
        return
    if is_encoder_dir(model_dir):
        return
    refusal = hybrid_refusal(spec_from_hf_config(load_hf_config(model_dir)), config)
    if refusal is not None:
        raise ValueError(refusal)
