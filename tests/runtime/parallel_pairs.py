"""The scaffolding the tensor- and pipeline-parallel exactness tests share: a TP=1 engine beside a
multi-rank engine of one model and config, at most one multi-rank engine alive at a time, and the
scenarios both compare token for token (staggered greedy requests, chunked context, preemption,
prefix-cache hits, seeded sampling, aborts). Knows nothing about how the ranks are laid out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

from .hf_reference import prompts_of_lengths, run_staggered

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 40]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]
# A cache of 14 blocks x 16 tokens: the staggered prompts do not all fit, so some are preempted.
CONFIG = dict(num_kv_blocks=14, block_size=16, max_num_tokens=512, enable_prefix_caching=True)
Tokens = dict[str, list[int]]


class Pair(Protocol):
    """A TP=1 engine (``one``) and a multi-rank engine (``two``, owned by ``llm``)."""

    one: LLMEngine
    two: LLMEngine
    llm: object

    def run(self, prompts: list[list[int]], params: list[SamplingParams], **knobs) -> list[Tokens]: ...


P = TypeVar("P", bound=Pair)


def run_both(
    engines: tuple[LLMEngine, LLMEngine], prompts: list[list[int]], params: list[SamplingParams], **knobs
) -> list[Tokens]:
    """The same staggered requests through each engine (``max_num_tokens``, ``per_step`` knobs);
    each must end with nothing running, waiting or holding a KV block."""
    results = []
    for engine in engines:
        engine.update_config(max_num_tokens=knobs.get("max_num_tokens", CONFIG["max_num_tokens"]))
        engine.pool.reset_prefix_cache()
        results.append(run_staggered(engine, prompts, params, knobs.get("per_step", 3)))
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == stats.num_used_kv_blocks == 0, "KV blocks leaked"
    return results


def one_live(make: Callable[..., P]) -> Iterator[Callable[..., P]]:
    """A module fixture's body: ``get(*key)`` makes the pair of ``key``, closing the one alive
    before (torch.distributed's group is per process); the last is closed at teardown."""
    live: dict[tuple, P] = {}

    def get(*key) -> P:
        if key not in live:
            for old in live.values():
                old.llm.close()  # type: ignore[attr-defined]
            live.clear()
            live[key] = make(*key)
        return live[key]

    yield get
    for pair in live.values():
        pair.llm.close()  # type: ignore[attr-defined]


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], temperature=0.0) for i in range(n)]


def run_shared_scenario(pair: Pair, scenario: str, prompts: list[list[int]]) -> tuple[Tokens, Tokens] | None:
    """Run ``scenario`` if it is one both suites share (``chunked``, ``preemption``, ``prefix``,
    ``seeded``) and check what it must show; ``None`` for any other scenario."""
    before = [e.stats() for e in (pair.one, pair.two)]
    if scenario == "chunked":
        one, two = pair.run(prompts, greedy(len(prompts)), max_num_tokens=24)
    elif scenario == "preemption":
        one, two = pair.run(prompts, greedy(len(prompts)), max_num_tokens=256, per_step=16)
        for engine, b in zip((pair.one, pair.two), before, strict=True):
            assert engine.stats().num_preemptions > b.num_preemptions, "the small cache forced no preemption"
    elif scenario == "prefix":
        shared = prompts_of_lengths(pair.two.tokenizer, [49])[0]
        prefixed = [shared + p[1:] for p in prompts[:8]]
        one, two = pair.run(prefixed, greedy(len(prefixed)), per_step=1)
        for engine, b in zip((pair.one, pair.two), before, strict=True):
            assert engine.stats().prefix_cache_hits > b.prefix_cache_hits, "no prefix-cache hit"
    elif scenario == "seeded":
        params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(8)]
        one, two = pair.run(prompts[:8], params)
    else:
        return None
    return one, two


def run_with_aborts(engine: LLMEngine, prompts: list[list[int]], *, keep_aborted: bool) -> Tokens:
    """Abort every other request after four steps; the rest run to the end; no block leaks.
    ``keep_aborted=False``: the aborted requests' tokens are not compared (with steps in flight,
    how far an aborted request got depends on them)."""
    engine.pool.reset_prefix_cache()
    tokens: Tokens = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, temperature=0.0))
    for step in range(400):
        if step == 4:
            for i in range(1, len(prompts), 2):
                assert engine.abort_request(str(i)) is not None
                if not keep_aborted:
                    tokens[str(i)] = []
        for out in engine.step():
            if keep_aborted or int(out.req_id) % 2 == 0:
                tokens[out.req_id].extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return tokens
