"""``\\d``, ``\\w``, ``\\s`` in a regex constraint or a JSON schema's patterns are ECMA-262's
classes (``\\d`` is ``[0-9]``): the rewrite itself, llguidance's matcher on it, and the served
model pushed by a logit bias towards U+1FBF8 (a digit to Unicode) that a pattern must refuse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inflight.runtime.structured import StructuredOutputsParams
from inflight.runtime.structured.ascii_classes import ascii_classes, schema_ascii_classes
from tests.server.server_helpers import MODEL_NAME, LiveServer, client_for

ODD_DIGIT = "\U0001fbf8"  # SEGMENTED DIGIT EIGHT: Unicode category Nd
# ECMA-262's WhiteSpace and LineTerminator code points
ECMA_SPACE = {*"\t\n\v\f\r \u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff", *map(chr, range(0x2000, 0x200B))}


@pytest.mark.parametrize(("pattern", "expected"), [
    (r"\d{3}", r"[\x{30}-\x{39}]{3}"),
    (r"[\d-]", r"[\x{30}-\x{39}-]"),
    (r"[^\d]", r"[^\x{30}-\x{39}]"),
    (r"\D", r"[\x{0}-\x{2F}\x{3A}-\x{10FFFF}]"),
    (r"[\W]", r"[\x{0}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{5E}\x{60}\x{7B}-\x{10FFFF}]"),
    (r"\\d", r"\\d"),  # an escaped backslash, then a plain d
    (r"\\\d", r"\\[\x{30}-\x{39}]"),
    (r"\[\d\]", r"\[[\x{30}-\x{39}]\]"),  # escaped brackets open no class
    (r"[]\d]", r"[]\x{30}-\x{39}]"),  # a leading ] is a literal in the class
    (r"[[:alpha:]\d]x\d", r"[[:alpha:]\x{30}-\x{39}]x[\x{30}-\x{39}]"),
    (r"\p{L}\.\x41", r"\p{L}\.\x41"),  # other escapes as written
    ("abc", "abc"),
])
def test_rewrite(pattern: str, expected: str) -> None:
    assert ascii_classes(pattern) == expected


@pytest.mark.parametrize("escape", ["d", "D", "w", "W", "s", "S"])
def test_classes_equal_ecma_sets(escape: str) -> None:
    """Python's ``re.ASCII`` is ECMA's \\d and \\w; \\s is ECMA's own set (not Python's)."""
    py = _to_python(ascii_classes("\\" + escape))
    for code in [*range(0x3100), 0xFEFF, 0x1FBF8, 0x10FFFF, 0x2028, 0x0085]:
        char = chr(code)
        if escape.lower() == "s":
            inside = char in ECMA_SPACE
        else:
            inside = re.fullmatch(f"\\{escape.lower()}", char, re.ASCII) is not None
        assert (re.fullmatch(py, char) is not None) == (inside if escape.islower() else not inside), (escape, hex(code))


def _to_python(pattern: str) -> str:
    return re.sub(r"\\x\{([0-9A-F]+)\}", lambda m: f"\\U{int(m.group(1), 16):08x}", pattern)


def test_schema_patterns_rewritten_and_data_left_alone() -> None:
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": r"^\d$"}},
              "patternProperties": {r"^\w+$": {"type": "integer"}}, "enum": [r"\d"],
              "items": [{"pattern": r"\s"}], "$defs": {"x": {"pattern": r"\\d"}}}
    out = schema_ascii_classes(schema)
    assert out["properties"]["pattern"]["pattern"] == r"^[\x{30}-\x{39}]$"
    assert list(out["patternProperties"]) == [ascii_classes(r"^\w+$")]
    assert out["enum"] == [r"\d"] and out["$defs"]["x"]["pattern"] == r"\\d"
    assert out["items"][0]["pattern"] == ascii_classes(r"\s")


def test_written_out_size_is_bounded() -> None:
    """``\\S`` grows ~90 times: a constraint past the bound is refused (a 400), not compiled."""
    from inflight.runtime.structured.manager import to_llguidance_grammar

    for params in (StructuredOutputsParams.regex("\\S" * 20_000),
                   StructuredOutputsParams.json_schema({"type": "string", "pattern": "\\S" * 20_000})):
        with pytest.raises(ValueError, match="once its .* classes are written out"):
            to_llguidance_grammar(params)
    assert to_llguidance_grammar(StructuredOutputsParams.regex("\\S" * 1_000))


def _matcher_accepts(tokenizer, llg_tokenizer, params: StructuredOutputsParams, text: str) -> bool:  # noqa: ANN001
    import llguidance

    from inflight.runtime.structured.manager import to_llguidance_grammar

    matcher = llguidance.LLMatcher(llg_tokenizer, to_llguidance_grammar(params), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    import llguidance.hf
    from transformers import AutoTokenizer

    from inflight.runtime.demo.model import make_demo_model

    model_dir: Path = make_demo_model(tmp_path_factory.mktemp("ascii") / "m", size="tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def test_compiled_constraints_refuse_unicode_digits(tokenizers) -> None:  # noqa: ANN001
    regex = StructuredOutputsParams.regex(r"\d{3}-\d{4}")
    assert _matcher_accepts(*tokenizers, regex, "555-1234")
    assert not _matcher_accepts(*tokenizers, regex, ODD_DIGIT * 3 + "-" + ODD_DIGIT * 4)
    assert not _matcher_accepts(*tokenizers, StructuredOutputsParams.regex(r"\w+"), "é")
    assert _matcher_accepts(*tokenizers, StructuredOutputsParams.regex(r"\s"), "\ufeff")  # ECMA's, not Rust's
    assert not _matcher_accepts(*tokenizers, StructuredOutputsParams.regex(r"\s"), "\u0085")
    assert _matcher_accepts(*tokenizers, StructuredOutputsParams.regex(r"\\d"), "\\d")
    schema = StructuredOutputsParams.json_schema({"type": "string", "pattern": r"^\d{3}-\d{4}$"})
    assert _matcher_accepts(*tokenizers, schema, '"555-1234"')
    assert not _matcher_accepts(*tokenizers, schema, json.dumps(ODD_DIGIT * 3 + "-" + ODD_DIGIT * 4,
                                                                  ensure_ascii=False))


def _bias_to_odd_digit(server: LiveServer) -> dict[str, int]:
    """Every token of U+1FBF8's bytes pushed to the top: unconstrained, the model writes it."""
    ids = server.engine.tokenizer.encode(ODD_DIGIT, add_special_tokens=False)
    return {str(i): 100 for i in ids}


PHONE = re.compile(r"[0-9]{3}-[0-9]{4}")


def test_served_regex_writes_ascii_digits(llama_server: LiveServer) -> None:
    client = client_for(llama_server)
    bias = _bias_to_odd_digit(llama_server)
    # Where a pattern allows any Unicode digit (what \d matched before), the bias makes the model write U+1FBF8.
    unicode_digits = client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=40, logit_bias=bias, temperature=0,
        extra_body={"guided_regex": r"\p{Nd}{3}-\p{Nd}{4}"}).choices[0]
    assert unicode_digits.text == ODD_DIGIT * 3 + "-" + ODD_DIGIT * 4
    for body in ({"guided_regex": r"\d{3}-\d{4}"}, {"structured_outputs": {"regex": r"\d{3}-\d{4}"}}):
        out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=20, logit_bias=bias,
                                        temperature=0, extra_body=body).choices[0]
        assert out.finish_reason == "stop" and PHONE.fullmatch(out.text), out.text


def test_served_schema_pattern_writes_ascii_digits(llama_server: LiveServer) -> None:
    client = client_for(llama_server)
    schema = {"type": "object", "properties": {"phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"}},
              "required": ["phone"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "phone?"}], max_tokens=30, temperature=0,
        logit_bias=_bias_to_odd_digit(llama_server),
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}).choices[0]
    assert out.finish_reason == "stop"
    assert PHONE.fullmatch(json.loads(out.message.content)["phone"]), out.message.content
