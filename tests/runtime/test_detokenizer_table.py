"""IncrementalDetokenizer by table, on a byte-level tokenizer (one token per byte, so every
multi-byte character is split across tokens): streamed deltas concatenate to the final text,
never carry a half character, never hand out a stop string or text past it, and the last
(longest stop - 1) characters wait for more text or the end, so no delta is taken back."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from inflight.runtime.engine_core.detokenizer import IncrementalDetokenizer

EOS = 256


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    assert tok.convert_tokens_to_ids("<eos>") == EOS
    return tok


def _ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte
    return ids


def _stream(tok: PreTrainedTokenizerFast, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str, bool]:
    detok = IncrementalDetokenizer(tok, stop, frozenset({EOS}))
    deltas, stopped = [], False
    for token_id in ids:
        stopped = detok.append(token_id)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        detok.flush()
        deltas.append(detok.take_delta(finished=True))
    return deltas, detok.text, stopped


CASES = [  # (generated text, stop strings, final text, stopped)
    ("plain ascii text", (), "plain ascii text", False),
    ("héllo 世界 🎉 done", (), "héllo 世界 🎉 done", False),
    ("abc STOP def", ("STOP",), "abc ", True),
    ("abc STO but not", ("STOP",), "abc STO but not", False),  # held back, then released
    ("ends with a partial ST", ("STOP",), "ends with a partial ST", False),  # released at the end
    ("price 世界 then more", ("世界",), "price ", True),  # a stop of multi-byte characters
    ("a 🎉b", ("🎉",), "a ", True),  # a 4-byte stop character split over 4 tokens
    ("two stops: xx then yy", ("yy", "xx"), "two stops: ", True),  # the earliest wins
    ("overlap aab", ("ab",), "overlap a", True),
]


@pytest.mark.parametrize(("text", "stop", "final", "stopped"), CASES, ids=[c[0] for c in CASES])
def test_deltas_concatenate_to_the_final_text(tokenizer, text: str, stop: tuple[str, ...], final: str,
                                              stopped: bool) -> None:
    deltas, full, was_stopped = _stream(tokenizer, _ids(tokenizer, text), stop)
    assert (full, was_stopped) == (final, stopped)
    assert "".join(deltas) == final
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    for s in stop:
        assert s not in "".join(deltas)


def test_the_last_len_stop_minus_one_characters_wait_for_more_text_or_the_end(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ("STOP",), frozenset({EOS}))
    seen = ""
    for ch in "xST":
        detok.append(_ids(tokenizer, ch)[0])
        seen += detok.take_delta(finished=False)
    assert seen == ""  # "xST": "ST" may become "STOP", and the hold-back keeps len(STOP)-1 characters
    detok.append(_ids(tokenizer, "x")[0])  # "xSTx": nothing can start a stop any more at "x"
    seen += detok.take_delta(finished=False)
    assert seen == "x"  # what is clear of the last 3 characters is handed out
    detok.flush()
    assert seen + detok.take_delta(finished=True) == "xSTx"


def test_eos_is_never_text_and_a_broken_character_is_flushed_at_the_end(tokenizer) -> None:
    ids = _ids(tokenizer, "ok ") + [EOS] + _ids(tokenizer, "世")[:2]  # the request ends mid-character
    deltas, full, stopped = _stream(tokenizer, ids)
    assert not stopped and "<eos>" not in full
    assert full.startswith("ok ") and "".join(deltas) == full
    assert full.endswith("\ufffd")  # the stray bytes show as a replacement character, once, at the end


@pytest.mark.parametrize(("text", "stop", "hit"), [
    ("two stops: xx then yy", ("yy", "xx"), "xx"),  # the earliest in the text, not the first listed
    ("price 世界 then more", ("more", "世界"), "世界"),
    ("no stop here", ("STOP",), None),
])
def test_the_stop_string_that_ended_the_text_is_named(tokenizer, text: str, stop: tuple[str, ...],
                                                      hit: str | None) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop, frozenset({EOS}))
    for token_id in _ids(tokenizer, text):
        if detok.append(token_id):
            break
    assert detok.stop_hit == hit
