"""Malformed requests for the hostile-traffic suite: hypothesis strategies over the request
schema (one field wrong at a time, on a body that is otherwise valid) plus fixed tables of
raw-byte bodies, header and encoding attacks. Each probe carries the statuses that count as
the right answer. Knows nothing about running a server."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

VOCAB = 1024  # the tiny demo model's vocabulary
MODEL = "demo"
C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_REQUEST = frozenset({400})


@dataclass(frozen=True, slots=True)
class Probe:
    """One request sent as raw bytes, and the statuses that are the right answer."""

    name: str
    data: bytes
    expected: frozenset[int]


def http_request(path: str, body: bytes, headers: dict[str, str] | None = None, *, key: str | None,
                 raw_headers: bytes = b"", method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             f"Content-Length: {len(body)}", "Content-Type: application/json"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n").encode() + raw_headers + b"\r\n" + body


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


# ---- hypothesis: one field wrong ------------------------------------------------------

_junk = st.one_of(st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_huge = st.integers(min_value=2**64, max_value=2**200)
_floats = st.floats(allow_nan=True, allow_infinity=True)


# JSON integers too large for a float (float(10**309) raises OverflowError), either sign.
_beyond_float = st.integers(min_value=10**309, max_value=10**400).flatmap(lambda n: st.sampled_from([n, -n]))


def _outside(low: float, high: float, *, low_ok: bool = True) -> st.SearchStrategy[float]:
    below = st.floats(max_value=low, exclude_max=low_ok, allow_nan=False)
    above = st.floats(min_value=high, exclude_min=True, allow_nan=False)
    return st.one_of(below, above, st.just(float("nan")), _junk, _beyond_float)


def _not_int(strategy: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, st.floats(allow_nan=False).filter(lambda f: f != int(f) if f == f and abs(f) < 1e300 else True),
                     st.text(min_size=1, max_size=6), st.booleans())


BAD_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": _not_int(st.one_of(st.integers(max_value=0), st.integers(min_value=400, max_value=2**70))),
    "temperature": _outside(0.0, 2.0),
    "top_p": _outside(0.0, 1.0, low_ok=False),
    "top_k": _not_int(st.one_of(st.integers(max_value=-2), st.integers(min_value=2**31, max_value=2**80))),
    "min_p": _outside(0.0, 1.0),
    "presence_penalty": _outside(-2.0, 2.0),
    "frequency_penalty": _outside(-2.0, 2.0),
    "repetition_penalty": _outside(0.0, 10.0, low_ok=False),
    "seed": _not_int(st.one_of(st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1))),
    "stop": st.one_of(st.just(""), st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=20),
                      st.lists(st.text(min_size=257, max_size=300), min_size=1, max_size=1),
                      st.lists(st.integers(), min_size=1, max_size=3), st.integers(), st.just([""])),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=VOCAB, max_value=2**70), min_size=1, max_size=4),
                                st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                                st.lists(st.integers(0, VOCAB - 1), min_size=257, max_size=300),
                                st.text(max_size=4), st.integers(), st.lists(st.text(max_size=2), min_size=1, max_size=2)),
    "min_tokens": _not_int(st.one_of(st.integers(max_value=-1), st.integers(min_value=9, max_value=2**70))),
    "n": _not_int(st.one_of(st.integers(max_value=0), st.integers(min_value=17, max_value=2**70))),
    "logprobs": _not_int(st.one_of(st.integers(max_value=-1), st.integers(min_value=21, max_value=2**70))),
    "prompt": st.one_of(
        st.just([]), st.just([[]]), st.integers(), st.booleans(), st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2),
        st.lists(st.integers(min_value=VOCAB, max_value=2**70), min_size=1, max_size=3),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.tuples(st.text(min_size=1, max_size=4), st.integers(0, 10)).map(list),
        st.lists(st.text(min_size=1, max_size=3), min_size=65, max_size=70)),
    "stream": st.one_of(st.integers(), st.text(max_size=3), st.lists(st.booleans(), max_size=2)),
    # The suite's server schedules fcfs, which ignores priority: any non-zero one is refused.
    "priority": _not_int(st.one_of(st.integers(min_value=1), st.integers(max_value=-1))),
    "user": st.one_of(st.integers(), st.lists(st.text(max_size=3), min_size=1, max_size=2), st.booleans()),
}
BAD_CHAT_MESSAGES = st.one_of(
    st.just([]), st.text(max_size=5), st.integers(), st.lists(st.integers(), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.text(max_size=6).filter(
        lambda r: r not in ("system", "developer", "user", "assistant", "tool")), "content": st.text(max_size=5)}),
        min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(st.integers(), st.booleans(),
             st.lists(st.integers(), min_size=1, max_size=2))}), min_size=1, max_size=2),
)


def bad_completion_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    return st.sampled_from(sorted(BAD_FIELDS)).flatmap(
        lambda name: BAD_FIELDS[name].map(lambda value: (name, {**base, name: value})))


def bad_chat_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat_fields = {k: v for k, v in BAD_FIELDS.items() if k not in ("prompt", "logprobs")}
    messages = BAD_CHAT_MESSAGES.map(lambda m: ("messages", {**base, "messages": m}))
    fields = st.sampled_from(sorted(chat_fields)).flatmap(
        lambda name: chat_fields[name].map(lambda value: (name, {**base, name: value})))
    return st.one_of(messages, fields)


def draw(strategy: st.SearchStrategy[Any], max_examples: int) -> list[Any]:
    """Up to ``max_examples`` deterministic examples of ``strategy`` (hypothesis as generator)."""
    out: list[Any] = []

    @settings(max_examples=max_examples, database=None, derandomize=True, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out


def _deep_json_text() -> st.SearchStrategy[str]:
    """JSON text nested past the 64-level limit (arrays, objects or both), as a string value."""
    depth = st.integers(min_value=65, max_value=20_000)
    arrays = depth.map(lambda d: "[" * d + "]" * d)
    objects = depth.map(lambda d: '{"a":' * d + "1" + "}" * d)
    unclosed = depth.map(lambda d: "[" * d)
    return st.one_of(arrays, objects, unclosed)


def nested_string_bodies() -> st.SearchStrategy[tuple[str, str, dict[str, Any]]]:
    """(path, field, body) with deeply nested JSON inside a string field of an otherwise valid body."""
    msgs = [{"role": "user", "content": "hi"}]

    def history(args: str) -> list[dict[str, Any]]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        return [*msgs, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]

    return _deep_json_text().flatmap(lambda text: st.sampled_from([
        (C, "guided_json", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": text}),
        (C, "structured_outputs", {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": text}}),
        (CHAT, "messages", {"model": MODEL, "messages": history(text), "max_tokens": 4}),
        ("/tokenize", "messages", {"model": MODEL, "messages": history(text)}),
    ]))  # fmt: skip


def schema_probes(key: str, max_examples: int) -> list[Probe]:
    probes = []
    for path, field, body in draw(nested_string_bodies(), max(8, max_examples // 4)):
        probes.append(Probe(f"{path} deep JSON in {field}", http_request(path, _json(body), key=key), BAD_REQUEST))
    for path, strategy in ((C, bad_completion_bodies()), (CHAT, bad_chat_bodies())):
        for field, body in draw(strategy, max_examples):
            probes.append(Probe(f"{path} bad {field}", http_request(path, _json(body), key=key), BAD_REQUEST))
    return probes


# ---- fixed tables ----------------------------------------------------------------------

def raw_body_probes(key: str) -> list[Probe]:
    valid = b'{"model": "demo", "prompt": "hello world", "max_tokens": 4}'
    bodies = {
        "int-5000-digits": b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}",
        "int-4300-digits-seed": b'{"model": "demo", "prompt": "x", "seed": ' + b"7" * 4300 + b"}",
        "nesting-100000": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nesting-2000-objects": b'{"user": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b"}",
        "nesting-65": b'{"prompt": "x", "metadata": ' + b"[" * 65 + b"]" * 65 + b"}",
        "lone-surrogate-prompt": b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 2}',
        "lone-low-surrogate-list": b'{"model": "demo", "prompt": ["ok", "\\udc00"], "max_tokens": 2}',
        "lone-surrogate-stop": b'{"model": "demo", "prompt": "x", "stop": ["\\ud83d"]}',
        "lone-surrogate-chat": b'{"model": "demo", "messages": [{"role": "user", "content": "\\udbff"}]}',
        "invalid-utf8": b'{"model": "demo", "prompt": "\xc3\x28", "max_tokens": 2}',
        "utf16-body": '{"prompt": "x"}'.encode("utf-16"),
        "top-level-list": b"[1, 2, 3]",
        "top-level-string": b'"prompt"',
        "top-level-number": b"42",
        "top-level-null": b"null",
        "empty": b"",
        "whitespace": b"   \n\t ",
        "nan-temperature": b'{"model": "demo", "prompt": "x", "temperature": NaN}',
        "infinity-top-p": b'{"model": "demo", "prompt": "x", "top_p": Infinity}',
        "duplicate-trailing-garbage": valid + b"}}}",
        "nul-bytes": b"\x00" * 64,
        "binary-garbage": bytes(range(256)),
        "single-quotes": b"{'prompt': 'x'}",
        "comment": b'{"prompt": "x" /* hi */}',
        "big-float": b'{"model": "demo", "prompt": "x", "temperature": 1e999}',
        "neg-zero-max-tokens": b'{"model": "demo", "prompt": "x", "max_tokens": -0}',
    }
    for cut in range(1, len(valid) - 1, 4):
        bodies[f"truncated-at-{cut}"] = valid[:cut]
    return [Probe(f"raw {name}", http_request(C, body, key=key), BAD_REQUEST) for name, body in bodies.items()]


def header_probes(key: str) -> list[Probe]:
    body = b'{"model": "demo", "prompt": "hello", "max_tokens": 2}'
    probes = []
    for enc, payload in (("gzip", body), ("gzip", gzip.compress(body)[:20]), ("deflate", body), ("br", body),
                         ("gzip, gzip", gzip.compress(body)), ("zstd", b"\x28\xb5\x2f\xfd garbage")):
        probes.append(Probe(f"content-encoding {enc} bad", http_request(C, payload, {"Content-Encoding": enc}, key=key),
                            frozenset({400, 415})))
    for name, value in (("non-ascii", b"Bearer \xff\xfe"), ("latin1", "Bearer cl\xe9".encode("latin-1")),
                        ("utf8-suffix", f"Bearer {key}\u00e9".encode()), ("no-scheme", key.encode()),
                        ("wrong-key", b"Bearer nope"), ("empty", b""), ("basic", b"Basic dXNlcjpwYXNz")):
        data = http_request(C, body, key=None, raw_headers=b"Authorization: " + value + b"\r\n")
        probes.append(Probe(f"authorization {name}", data, frozenset({401})))
    for name, line in (("ctl-in-auth", f"Authorization: Bearer {key}\x01\r\n".encode()),
                       ("no-colon", f"Authorization Bearer {key}\r\n".encode()),
                       ("bad-content-length", b"Content-Length: abc\r\n"),
                       ("space-before-colon", b"X-Thing : 1\r\n")):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n"
        probes.append(Probe(f"parser {name}", head, BAD_REQUEST))
    for name, head in (
        ("long-header-line", b"X-Long: " + b"a" * 20_000 + b"\r\n"),
        ("too-many-headers", b"".join(b"X-H%d: 1\r\n" % i for i in range(300))),
        ("cl-and-te", b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
        ("two-content-lengths", b"Content-Length: 5\r\nContent-Length: 6\r\n"),
        ("bad-transfer-encoding", b"Transfer-Encoding: gzip, identity\r\n"),
    ):
        probes.append(Probe(f"parser {name}", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\nhello",
                            frozenset({400, 413, 431, 501})))
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               + f"Authorization: Bearer {key}\r\n".encode() + b"\r\nzz\r\n{}\r\n0\r\n\r\n")
    probes.append(Probe("parser bad-chunk-size", chunked, BAD_REQUEST))
    probes.append(Probe("parser bad-method", b"GARB AGE\r\n\r\n", BAD_REQUEST))
    probes.append(Probe("parser bad-version", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n", frozenset({400, 505})))
    probes.append(Probe("admin with inference key", http_request("/admin/config", b'{"max_queue_len": 0}', key=key),
                        frozenset({401})))
    probes.append(Probe("unknown route", http_request("/v1/nothing", body, key=key), frozenset({404})))
    probes.append(Probe("wrong method", http_request(C, b"", key=key, method="GET"), frozenset({405})))
    probes.append(Probe("body too large", http_request(C, b'{"prompt": "' + b"x" * 1_100_000 + b'"}', key=key),
                        frozenset({413})))
    return probes


def poison_probes(key: str) -> list[Probe]:
    """Schema-valid requests the loaded model cannot run: refused before the engine (400)."""
    bodies = [
        {"min_tokens": 1, "max_tokens": 4, "stop_token_ids": [VOCAB]},
        {"min_tokens": 2, "max_tokens": 4, "stop_token_ids": [10**9]},
        {"top_k": 2**64, "temperature": 1.0},
        {"seed": 2**64, "temperature": 0.7},
        {"prompt": [1, 2, VOCAB + 5]},
        {"prompt": ["a"] * 64, "n": 2},
        {"prompt": ["a"] * 20, "n": 16},  # more sequences than one request may ask for
        {"temperature": 10**400},
        {"prompt": "x " * 400, "max_tokens": 4},
        {"max_tokens": 10**6},
    ]
    return [Probe(f"poison {sorted(b)}", http_request(C, _json({"model": MODEL, "prompt": "hi", "max_tokens": 4, **b}),
                                                   key=key), BAD_REQUEST) for b in bodies]


# ---- costly work within the limits -----------------------------------------------------
# Requests that are valid but expensive: each must end as a 200 (a success, or a stream that
# ends with [DONE]), a 400 in the OpenAI shape (a compile refused, a matcher that failed or
# ran past its mask deadline) or a 429 (this client has too many compiles under way, or has
# used its compile allowance: all these probes come from one client), never a 5xx or a hang.
SERVED = frozenset({200, 400, 429})


def _wide_schema(num_props: int, depth: int) -> dict[str, Any]:
    """An object schema with ``num_props`` optional properties, nested ``depth`` levels."""
    leaf: dict[str, Any] = {"type": "object", "properties": {
        f"p{i}": ({"type": "integer"} if i % 3 else {"type": "string", "maxLength": 4}) for i in range(num_props)}}
    for _ in range(depth):
        leaf = {"type": "object", "properties": {"a": leaf, "b": {"type": "array", "items": leaf}}}
    return leaf


_AMBIGUOUS_GRAMMARS = (
    'start: x\nx: x x x | x x | "a" | "b" | "c"\n',
    'start: x\nx: x x x x | x x x | x x | "a" | "b" | "aa" | "ab"\n',
    'start: s\ns: s s | "(" s ")" | "(" ")" | s "," s | "x"\n',
)
_AMBIGUOUS_REGEXES = ("(a|a)*b", "(a*)*b", "(a|ab|b)*c", "((a|b)*(a|b)*)*z", "([a-z]*[a-z]*)*x", "(x+x+)+y",
                      "(.*a){12}", "[ab]*a[ab]{20}")


def expensive_grammar_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(what, body): a large JSON schema (within 256 KiB), an ambiguous Lark grammar or an
    ambiguous regex, on /v1/completions with a few tokens to generate."""
    base = {"model": MODEL, "prompt": "x", "max_tokens": 24, "temperature": 1.0}
    schemas = st.tuples(st.integers(50, 1500), st.integers(0, 3)).map(
        lambda nd: (f"schema {nd[0]} props depth {nd[1]}", {**base, "guided_json": _wide_schema(*nd)}))
    grammars = st.sampled_from(_AMBIGUOUS_GRAMMARS).map(lambda g: ("ambiguous grammar", {**base, "guided_grammar": g}))
    regexes = st.sampled_from(_AMBIGUOUS_REGEXES).map(lambda r: (f"regex {r}", {**base, "guided_regex": r}))
    return st.one_of(schemas, grammars, regexes)


# Tool-call text the parsers once choked on (backtracking over whitespace, deep nesting,
# unclosed strings, many calls), as regexes the constraint makes the model write.
_TOOL_TEXT_REGEXES = (
    "<tool_call>x {%d}y", "<tool_call>\\{\"name\": \"f\", \"arguments\": \\[{%d}", "\\[{%d}",
    "\\{\"name\": \"f\", \"parameters\": \\{\"a\": \"[ ]{%d}", "(<tool_call>){%d}",
    "\\[TOOL_CALLS\\]\\[\\{\"name\": \"f\", \"arguments\": \\{{%d}", "<\\|python_tag\\|>\\{{%d}",
    "\\{\"name\": \"f\"[ \\n]{%d}\\}",
)
_TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}]


def tool_output_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(what, chat body with ``tools``) whose regex steers the output into pathological tool-call text.

    The tools make the tiny model's chat prompt ~200 tokens of its 256, so the text is short
    here (its size, 100k characters, is the parser tests' and the isolation bench's part)."""
    shapes = st.tuples(st.sampled_from(_TOOL_TEXT_REGEXES), st.integers(8, 44), st.booleans())
    return shapes.map(lambda s: (f"tool text {s[0][:24]} x{s[1]}{' stream' if s[2] else ''}", {
        "model": MODEL, "messages": [{"role": "user", "content": "call f"}], "tools": _TOOLS, "tool_choice": "auto",
        "guided_regex": s[0] % s[1], "max_tokens": 54, "temperature": 0, "stream": s[2]}))


def huge_logprob_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(what, body) asking for more logprob entries than the server will build at once.

    On the suite's server (max_model_len 256, 8 running + 64 waiting) no request can pass the
    2**21-entry response ceiling before the 72-sequence queue check refuses it, so every draw
    asks for more sequences than that (with logprob products up to 64 x 16 x 200 x 21 entries,
    the issue's example): a 400 built before any work, never a response."""
    def body(d: tuple[int, int, int, int, int, bool]) -> tuple[str, dict[str, Any]]:
        n, num_prompts, tokens, k, pk, echo = d
        prompts = [[1 + (i + j) % (VOCAB - 1) for j in range(tokens)] for i in range(num_prompts)]
        extra: dict[str, Any] = {"echo": True} if echo else {"prompt_logprobs": pk}
        return (f"logprobs n={n} x {num_prompts} prompts x {tokens}", {
            "model": MODEL, "prompt": prompts, "n": n, "max_tokens": 256 - tokens, "logprobs": k, **extra})
    shapes = st.tuples(st.integers(5, 16), st.integers(1, 64), st.integers(8, 200), st.integers(0, 20),
                       st.integers(0, 20), st.booleans()).filter(lambda d: d[0] * d[1] > 72)
    return shapes.map(body)


def costly_probes(key: str, max_examples: int) -> list[Probe]:
    """A few draws of each costly class (their number grows slowly with ``max_examples``)."""
    each = max(3, max_examples // 40)
    probes = []
    for what, body in draw(expensive_grammar_bodies(), each * 2):
        probes.append(Probe(f"costly {what}", http_request(C, _json(body), key=key), SERVED))
    for what, body in draw(tool_output_bodies(), each * 2):
        probes.append(Probe(f"costly {what}", http_request(CHAT, _json(body), key=key), SERVED))
    for what, body in draw(huge_logprob_bodies(), each):
        probes.append(Probe(f"costly {what}", http_request(C, _json(body), key=key), BAD_REQUEST))
    return probes


# ---- the tokenizer routes without the key ----------------------------------------------

def unauthenticated_tokenizer_probes(key: str, max_examples: int) -> list[Probe]:
    """/tokenize and /detokenize without a key, with a wrong one or with ``Expect: 100-continue``:
    a 401 before the body is read (never a ``100 Continue``, never the tokenizer's answer)."""
    bodies = st.one_of(
        st.text(max_size=40).map(lambda t: {"model": MODEL, "prompt": t}),
        st.lists(st.integers(0, VOCAB - 1), max_size=20).map(lambda ids: {"model": MODEL, "tokens": ids}),
        st.just({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2000}]}))
    auth = st.sampled_from([None, "Bearer nope", f"Bearer {key}x", f"Basic {key}", key])
    shapes = st.tuples(st.sampled_from(["/tokenize", "/detokenize"]), auth, st.booleans(), bodies)
    probes = []
    for path, header, expect, body in draw(shapes, max(4, max_examples // 25)):
        raw = (b"Authorization: " + header.encode() + b"\r\n") if header is not None else b""
        raw += b"Expect: 100-continue\r\n" if expect else b""
        probes.append(Probe(f"{path} auth {header and header[:6]!r}{' expect' if expect else ''}",
                            http_request(path, _json(body), key=None, raw_headers=raw), frozenset({401})))
    return probes
