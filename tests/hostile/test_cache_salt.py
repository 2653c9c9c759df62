"""Issue 46, finding 3: the prefix cache answered guesses about other users' prompts.

The experiment: a victim's prompt holds a 4-token PIN in its second KV block; an attacker sends
the same template with each candidate PIN and reads how many of its prompt tokens were served
from the prefix cache (the ``prefix_cache_hits`` counter around each request on an otherwise
idle server; time to first token leaks the same bit). Without isolation the right guess shows
one more block of hits than the wrong ones. With a per-user ``cache_salt`` (vLLM's field, which
seeds the request's block hashes) and with ``--prefix-cache-isolation key``, the right guess
looks exactly like the wrong ones, while requests with the same salt (the same key) still share.
``/metrics`` itself is behind a key where the server has one. Every server runs its engine in
an engine-core process, as ``inflight serve`` does, so the salt crosses the process boundary.
Hit counts, never times."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.core.block_pool import KVBlockPool, hash_full_blocks
from inflight.runtime.core.input_checks import MAX_CACHE_SALT_CHARS, check_cache_salt
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.request import Request
from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams
from tests.server.server_helpers import LiveServer, http, parse_metrics

BLOCK = 16
MODEL = "demo"
VICTIM_KEY, ATTACKER_KEY, ADMIN_KEY, METRICS_KEY = "victim-key-1", "attacker-key-2", "admin-key-3", "metrics-key-4"
PREFIX = list(range(100, 100 + BLOCK))  # block 0: the template everyone shares (tests shift it)
SECRET = [700, 701, 702, 703]  # the victim's PIN, at the start of block 1
TAIL = list(range(500, 500 + BLOCK - len(SECRET))) + list(range(600, 608))  # the rest of the template
WRONG_GUESSES = [[700, 701, 702, 700 + d] for d in (4, 5, 6, 7, 8)] + [[710, 711, 712, 713]]
HITS = "inflight:prefix_cache_hits_total"


# ---- the block-hash level ----------------------------------------------------------------


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Run ``req``'s whole prompt into the cache; the tokens it found cached."""
    hits = kv.find_prefix_hit(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * BLOCK, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return len(hits) * BLOCK


def test_the_salt_seeds_every_block_hash_and_only_the_same_salt_shares() -> None:
    pool = KVBlockPool(64)
    kv = KVCacheManager(pool, BLOCK)
    tokens = PREFIX + SECRET + TAIL + [1]  # 45 tokens: two full blocks can hit
    params = SamplingParams(max_tokens=1)

    def request(name: str, salt: str | None) -> Request:
        return Request(name, tokens, params, cache_salt=salt)

    assert _admit(kv, request("alice-1", "alice")) == 0
    assert _admit(kv, request("alice-2", "alice")) == 2 * BLOCK  # the same salt shares
    assert _admit(kv, request("nobody", None)) == 0  # unsalted: a chain of its own
    assert _admit(kv, request("bob", "bob")) == 0
    assert _admit(kv, request("nobody-again", None)) == 2 * BLOCK
    salted = request("x", "alice")
    kv.find_prefix_hit(salted)
    unsalted = hash_full_blocks(tokens, BLOCK, root=pool.root_hash)
    assert len(salted.block_hashes) == len(unsalted) == 2
    assert all(a != b for a, b in zip(salted.block_hashes, unsalted, strict=True))  # every block, by chaining
    pool.check_invariants()


@pytest.mark.parametrize("salt", ["", 7, ["a"], "s" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_salt_is_refused_by_the_engine_check(salt: object) -> None:
    with pytest.raises(RequestRejectedError) as info:
        check_cache_salt(salt)
    assert info.value.param == "cache_salt" and "non-empty string" in str(info.value)
    check_cache_salt("s" * MAX_CACHE_SALT_CHARS)
    check_cache_salt(None)


def test_the_offline_llm_takes_a_salt_in_a_dict_prompt(model_dir: Path) -> None:
    from inflight.runtime import LLM

    prompt = PREFIX + SECRET + TAIL
    params = SamplingParams(max_tokens=1, temperature=0)
    with LLM(model_dir, max_num_sequences=2, num_kv_blocks=64, max_model_len=256, block_size=BLOCK) as llm:

        def cached(salt: str | None) -> int:
            item: dict[str, object] = {"prompt_token_ids": prompt}
            if salt is not None:
                item["cache_salt"] = salt
            return llm.generate([item], params)[0].num_cached_tokens

        assert [cached("a"), cached("a"), cached("b"), cached(None), cached(None)] == [0, 2 * BLOCK, 0, 0, 2 * BLOCK]
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], params)
        with pytest.raises(ValueError, match="exactly one of"):
            llm.generate([{"prompt": "x", "prompt_token_ids": prompt}], params)


# ---- the live experiment -----------------------------------------------------------------


def _serve(model_dir: Path, **settings: object) -> LiveServer:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.server import ServerSettings

    config = EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=256, block_size=BLOCK)
    server_settings = ServerSettings(model_name=MODEL, api_key=VICTIM_KEY, priority_api_key=ATTACKER_KEY,
                                     admin_api_key=ADMIN_KEY, **settings)  # type: ignore[arg-type]
    return LiveServer(model_dir, config, server_settings, engine_process=True).start()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("salt-model") / "demo", size="tiny")


@pytest.fixture(scope="module")
def shared(model_dir: Path) -> Iterator[LiveServer]:
    live = _serve(model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def isolated(model_dir: Path) -> Iterator[LiveServer]:
    live = _serve(model_dir, prefix_cache_isolation="key", metrics_api_key=METRICS_KEY)
    yield live
    live.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _hits(live: LiveServer, reader: str = ADMIN_KEY) -> float:
    reply = http("GET", f"{live.url}/metrics", headers=_auth(reader))
    assert reply.status == 200, reply.text
    return parse_metrics(reply.text)[HITS]


def _send(live: LiveServer, key: str, pin: list[int], salt: str | None = None, base: int = 100) -> int:
    """One completion of the template from ``base`` with ``pin`` in it; the prompt tokens it
    found cached (each test has a template of its own, so tests cannot feed each other)."""
    prefix = list(range(base, base + BLOCK))
    body: dict[str, object] = {"model": MODEL, "prompt": prefix + pin + TAIL, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    before = _hits(live)
    reply = http("POST", f"{live.url}/v1/completions", body, _auth(key))
    assert reply.status == 200, reply.text
    return int(_hits(live) - before)


def _guesses(live: LiveServer, key: str, salt: str | None, base: int) -> tuple[int, list[int]]:
    """(hits of the right guess, hits of each wrong one). A first throwaway guess caches the
    attacker's own copy of block 0, so every counted guess starts from the same state; the
    wrong ones go first so the right one cannot be helped by an earlier right guess."""
    _send(live, key, [720, 721, 722, 723], salt, base)
    wrong = [_send(live, key, pin, salt, base) for pin in WRONG_GUESSES]
    return _send(live, key, SECRET, salt, base), wrong


def test_without_isolation_the_right_guess_shows_one_more_block(shared: LiveServer) -> None:
    """Documents the leak that salts and isolation close: the cache is shared by design."""
    _send(shared, VICTIM_KEY, SECRET, base=100)  # the victim's request leaves its blocks cached
    right, wrong = _guesses(shared, ATTACKER_KEY, None, base=100)
    assert set(wrong) == {BLOCK} and right == 2 * BLOCK


def test_with_a_cache_salt_per_user_the_right_guess_looks_wrong(shared: LiveServer) -> None:
    assert _send(shared, VICTIM_KEY, SECRET, salt="victim-salt", base=200) == 0
    for attacker_salt in (None, "attacker-salt"):
        right, wrong = _guesses(shared, ATTACKER_KEY, attacker_salt, base=200)
        assert set(wrong) == {right} == {BLOCK}, (right, wrong)  # its own block 0, never the victim's
    assert _send(shared, VICTIM_KEY, SECRET, salt="victim-salt", base=200) == 2 * BLOCK  # the same salt shares


def test_with_isolation_by_key_the_right_guess_looks_wrong(isolated: LiveServer) -> None:
    assert _send(isolated, VICTIM_KEY, SECRET, base=300) == 0
    for attacker_salt in (None, "victim-salt"):  # not even the victim's salt reaches another key's blocks
        right, wrong = _guesses(isolated, ATTACKER_KEY, attacker_salt, base=300)
        assert set(wrong) == {right} == {BLOCK}, (right, wrong)
    assert _send(isolated, VICTIM_KEY, SECRET, base=300) == 2 * BLOCK  # the same key shares
    assert _send(isolated, VICTIM_KEY, SECRET, salt="split", base=300) == 0  # a salt splits within a key


@pytest.mark.parametrize("salt", ["", 12, None, "s" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_cache_salt_is_a_400_naming_it(shared: LiveServer, salt: object) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        reply = http("POST", shared.url + path, {"model": MODEL, "max_tokens": 1, "cache_salt": salt, **body},
                     _auth(VICTIM_KEY))
        if salt is None:  # null means absent, as in vLLM
            assert reply.status == 200, reply.text
            continue
        assert reply.status == 400 and reply.json()["error"]["param"] == "cache_salt", reply.text


def test_metrics_needs_a_key_where_the_server_has_one(shared: LiveServer, isolated: LiveServer) -> None:
    assert http("GET", f"{shared.url}/metrics").status == 401
    assert http("GET", f"{shared.url}/metrics", headers={"Authorization": "Bearer nope"}).status == 401
    for key in (VICTIM_KEY, ATTACKER_KEY, ADMIN_KEY):  # no metrics key: the server's own keys
        assert http("GET", f"{shared.url}/metrics", headers=_auth(key)).status == 200
    assert http("GET", f"{isolated.url}/metrics").status == 401
    for key in (VICTIM_KEY, ATTACKER_KEY):  # with a metrics key, inference keys no longer read it
        reply = http("GET", f"{isolated.url}/metrics", headers=_auth(key))
        assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
    for key in (METRICS_KEY, ADMIN_KEY):
        assert http("GET", f"{isolated.url}/metrics", headers=_auth(key)).status == 200
    assert http("GET", f"{shared.url}/health").status == 200  # probes stay open


def test_the_operator_scrapes_a_keyed_pod_with_its_admin_key(shared: LiveServer) -> None:
    """The autoscaler's scrape carries the pod's admin key, so /metrics behind keys keeps it working."""
    import asyncio

    import aiohttp

    from inflight.operator import metrics_scrape

    async def scrape(key: str | None) -> metrics_scrape.Scrape:
        async with aiohttp.ClientSession() as session:
            return await metrics_scrape.scrape_pod(session, metrics_scrape.PodTarget("pod", shared.url), 30.0, key)

    keyed = asyncio.run(scrape(ADMIN_KEY))
    assert keyed.error is None and keyed.metrics.kv_cache_usage is not None
    assert "HTTP 401" in (asyncio.run(scrape(None)).error or "")


@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, False),
    ({"apiKeySecretRef": {"name": "k"}}, False),  # the operator's scrape sends the admin key
    ({"inferencePool": {"enabled": True}}, False),  # no key: /metrics is open anyway
    ({"apiKeySecretRef": {"name": "k"}, "inferencePool": {"enabled": True}}, True),  # the picker sends no key
    ({"apiKeySecretRef": {"name": "k"}, "inferencePool": {"enabled": True},
      "engine": {"extraArgs": ["--metrics-api-key=$(M)"]}}, False),
])
def test_pods_open_metrics_only_for_an_endpoint_picker_that_cannot_send_a_key(
        overrides: dict[str, object], expected: bool) -> None:
    from inflight.operator import render
    from tests.operator.helpers import make_spec

    assert ("--open-metrics" in render.runtime_args(make_spec(overrides))) is expected


def test_the_isolation_salt_is_the_callers_key_or_the_gateways_tenant() -> None:
    from aiohttp.test_utils import make_mocked_request

    from inflight.runtime.server import ServerSettings
    from inflight.runtime.server.cache_isolation import engine_salt

    def salt(mode: str, headers: dict[str, str], client_salt: str | None = None) -> str | None:
        settings = ServerSettings(model_name=MODEL, api_key=VICTIM_KEY, priority_api_key=ATTACKER_KEY,
                                  prefix_cache_isolation=mode, tenant_header="x-tenant")
        return engine_salt(make_mocked_request("POST", "/v1/completions", headers=headers), settings, client_salt)

    victim = {"Authorization": f"Bearer {VICTIM_KEY}"}
    attacker = {"Authorization": f"bearer   {ATTACKER_KEY} "}
    assert salt("none", attacker, "s") == "s" and salt("none", attacker) is None
    assert salt("key", victim) != salt("key", attacker)
    assert salt("key", victim) == salt("key", {"Authorization": f"BEARER {VICTIM_KEY}"})  # one key, however spelt
    assert salt("key", attacker, "s") not in (salt("key", victim, "s"), salt("key", attacker), "s")
    assert salt("key", {**victim, "x-tenant": "a"}) == salt("key", victim)  # key mode ignores the header
    tenant_a = salt("tenant", {**victim, "x-tenant": "a"})
    assert tenant_a == salt("tenant", {**attacker, "x-tenant": "a"}) != salt("tenant", {**victim, "x-tenant": "b"})
    assert salt("tenant", victim) == salt("key", victim)  # no header: the caller's key
