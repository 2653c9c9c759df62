"""Glue between a parsed request's features and the handlers: rendering the chat template
(vLLM's ``add_generation_prompt`` / ``continue_final_message`` / ``add_special_tokens``), grammar
compilation off the event loop, the per-request output plan (reasoning / tool calls; for
``tool_choice: auto`` under the server's ``--enable-auto-tool-choice`` / ``--tool-call-parser``)
and what is added to a finished body (echo, prompt logprobs).

Knows the engine only through ``engine.structured`` (the grammar compiler) and its tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from inflight.runtime.server.compile_budget import CompileBudget
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai import echo
from inflight.runtime.server.openai.chat_output import ChatOutputPlan
from inflight.runtime.server.openai.protocol import GenerationRequest
from inflight.runtime.server.openai.reasoning import THINK_END, THINK_START
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, detect_family, format_markers, renders_tools
from inflight.runtime.server.openai.tool_parsers.harmony import is_harmony

if TYPE_CHECKING:
    from inflight.runtime.server.state import ServerSettings

# vLLM's answer when auto tool choice is off (its default; ours is --no-enable-auto-tool-choice).
AUTO_OFF = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NO_TOOLS_IN_TEMPLATE = (
    "this model's chat template does not render tools, so the model would never see them. Serve it "
    "with a template that does: --chat-template FILE (for SmolLM2 the builtin --chat-template "
    "smollm2-tools); or send tool_choice 'required' or a named function (a grammar makes the model "
    "call one), or leave 'tools' out")


def template_kwargs(req: GenerationRequest) -> dict[str, Any]:
    """Extra ``apply_chat_template`` arguments: the tools (unless tool_choice is none) and the
    client's ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``)."""
    features = req.features
    kwargs = dict(features.chat_template_kwargs)
    if features.tools and features.tool_choice != "none":
        kwargs["tools"] = [dict(t) for t in features.tools]
    return kwargs


def render_chat(tokenizer: Any, req: GenerationRequest) -> list[int]:
    """The chat's prompt token ids, rendered as vLLM does: the template's text (the generation
    prompt, or the final message left open to be continued), then tokenized with
    ``add_special_tokens`` (default false: the template writes its own BOS). 400 naming
    ``messages`` when the model has no template or the template refuses the messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    features = req.features
    try:
        text = tokenizer.apply_chat_template(
            list(req.messages or ()), add_generation_prompt=features.add_generation_prompt,
            continue_final_message=features.continue_final_message, tokenize=False, **template_kwargs(req),
        )
    except Exception as exc:  # the template's own checks (e.g. role order) raise
        raise bad_request(f"the chat template refused these messages: {str(exc)[:300]}", "messages") from None
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=bool(features.add_special_tokens))]


async def compile_constraint(engine: Any, req: GenerationRequest, budget: CompileBudget,
                             client: str) -> GenerationRequest:
    """``req`` with its grammar checked, once, in the compiler's worker pool (cached): its
    constraint then carries the verdict (the checked grammar text), which the engine only
    instantiates, and adding the request costs the engine loop a copy only. 400 naming the
    field when the grammar is invalid (it never reaches the engine); 429 when ``client`` is
    over its compile allowance (``budget``)."""
    structured = req.params.structured
    if structured is None:
        return req
    try:
        compiled = await budget.compile(client, lambda: engine.structured.submit(structured),
                                        lambda: engine.structured.known(structured))
    except ValueError as exc:
        raise bad_request(str(exc), req.features.constraint_param) from None
    params = dataclasses.replace(req.params, structured=structured.checked(compiled.grammar))
    return dataclasses.replace(req, params=params)


def output_plan(req: GenerationRequest, tokenizer: Any, prompt_ids: list[int],
                settings: ServerSettings | None = None) -> ChatOutputPlan:
    """How to read this chat request's output: reasoning split, and which tool-call format
    (``settings``: the server's ``enable_auto_tool_choice`` and ``tool_call_parser``)."""
    features = req.features
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    reasoning = THINK_START in template and features.chat_template_kwargs.get("enable_thinking", True) is not False
    starts_in = False
    if reasoning:
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        starts_in = tail.rstrip().endswith(THINK_START)
    mode: str | None = None
    if features.tool_choice == "auto":
        mode = auto_tool_mode(template, settings)
    elif features.tool_choice in ("required", "named"):
        mode = features.tool_choice
    harmony = is_harmony(template) or mode == "harmony"  # gpt-oss: read by channels (tool_parsers.harmony)
    return ChatOutputPlan(reasoning and not harmony, starts_in, mode, features.tool_name,
                          not features.parallel_tool_calls, tuple(features.tools or ()), harmony)


def keeps_special_tokens(plan: ChatOutputPlan, tokenizer: Any) -> bool:
    """Whether this output must be detokenized with its special tokens: a marker the plan's
    parsers read (tool-call format, harmony channels, ``<think>``) is a special token of this
    tokenizer, which the default detokenizing would drop before any parser saw it (vLLM's tool
    parsers turn ``skip_special_tokens`` off for the same reason)."""
    markers: list[str] = []
    if plan.reasoning:
        markers += (THINK_START, THINK_END)
    if plan.by_channels:
        markers += format_markers("harmony")
    elif plan.tool_mode not in (None, "required", "named"):
        markers += format_markers(plan.tool_mode)
    return bool(markers) and not _special_strings(tokenizer).isdisjoint(markers)


@functools.lru_cache(maxsize=8)
def _special_strings(tokenizer: Any) -> frozenset[str]:
    """The strings of a tokenizer's special tokens (its added tokens marked special, and the named ones)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    named = getattr(tokenizer, "all_special_tokens", None) or ()
    return frozenset(str(t) for t in added.values() if getattr(t, "special", False)) | frozenset(map(str, named))


def auto_tool_mode(template: str, settings: ServerSettings | None) -> str:
    """The tool-call family ``tool_choice: auto`` parses: ``--tool-call-parser``'s, else the one the
    template teaches. 400 when auto is off (``--no-enable-auto-tool-choice``, vLLM's default and
    message) or when the template does not render tools (naming ``--chat-template``)."""
    if settings is not None and settings.enable_auto_tool_choice is False:
        raise bad_request(AUTO_OFF, "tool_choice")
    if not renders_tools(template):
        raise bad_request(NO_TOOLS_IN_TEMPLATE, "tools")
    parser = settings.tool_call_parser if settings is not None else None
    return TOOL_CALL_PARSERS[parser] if parser is not None else detect_family(template)


def body_decorator(
    req: GenerationRequest, tokenizer: Any, prompt_ids: Sequence[Sequence[int]]
) -> Callable[[dict[str, Any], list[Any]], None] | None:
    """What to add to the finished body: echo and/or prompt logprobs (None: nothing)."""
    features = req.features
    best_of = features.best_of if features.best_of is not None and features.best_of > features_n(req) else None
    echoed = req.echo_text if req.is_chat else features.echo
    if not echoed and features.prompt_logprobs is None and best_of is None:
        return None
    cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id])
        return cache[token_id]

    if req.is_chat:
        return lambda body, choices: _decorate_chat(body, choices, req, token_text)
    texts = [p if isinstance(p, str) else tokenizer.decode(list(p)) for p in req.prompts]

    def decorate(body: dict[str, Any], choices: list[Any]) -> None:
        index = [c.index // req.n for c in choices]
        if best_of is not None:
            choices, index = echo.select_best(body, choices, features_n(req), best_of, features.wants_logprobs)
        echo.decorate_completion(body, choices, index, prompt_ids, texts, features.echo,
                                 features.prompt_logprobs is not None, token_text)

    return decorate


def _decorate_chat(body: dict[str, Any], choices: list[Any], req: GenerationRequest, token_text: Any) -> None:
    """A chat body's echo (the continued assistant text in front of each message's content, as
    vLLM answers) and prompt logprobs."""
    prefix = req.echo_text
    if prefix:
        for choice in body["choices"]:
            message = choice["message"]
            message["content"] = prefix + (message.get("content") or "")
    if req.features.prompt_logprobs is not None:
        echo.decorate_chat(body, choices, token_text)


def features_n(req: GenerationRequest) -> int:
    """The ``n`` the client asked for (``req.n`` is ``best_of`` once expanded)."""
    return req.features.client_n or req.n


def expand_best_of(req: GenerationRequest) -> GenerationRequest:
    """``best_of > n``: run ``best_of`` candidates per prompt, with logprobs to rank them by."""
    features = req.features
    if features.best_of is None or features.best_of <= req.n:
        return req
    logprobs = req.num_logprobs if req.num_logprobs is not None else 0
    return dataclasses.replace(
        req, n=features.best_of, num_logprobs=logprobs,
        params=dataclasses.replace(req.params, logprobs=logprobs),
        features=dataclasses.replace(features, client_n=req.n, wants_logprobs=req.num_logprobs is not None),
    )
