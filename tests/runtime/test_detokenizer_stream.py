"""The two decoders of :class:`IncrementalDetokenizer` give the same text: ``tokenizers``'
``DecodeStream`` and the Python window, fed many token sequences (random ids over the whole
vocabulary: special tokens, byte tokens that break UTF-8, spaces), hand out the same deltas at
the same tokens, with and without stop strings, and the whole text equals
``tokenizer.decode(all ids)``. Where the stream does not fit, it is not chosen."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from inflight.runtime.engine_core.detokenizer import IncrementalDetokenizer, stream_decoding


def stream_text(tokenizer: Any, ids: list[int], stream: Any | None, stop: tuple[str, ...] = (),
                skip: frozenset[int] = frozenset()) -> tuple[list[str], str, bool]:  # fmt: skip
    """Every delta, the final text and whether a stop string ended it, as OutputText reads them."""
    detok = IncrementalDetokenizer(tokenizer, stop, skip, stream)
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


def assert_decoders_agree(tokenizer: Any, num_sequences: int, seed: int = 0) -> None:
    backend = stream_decoding(tokenizer)
    assert backend is not None, "this tokenizer should decode with the stream"
    rng = random.Random(seed)
    vocab = len(tokenizer)
    for n in range(num_sequences):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 48))]
        window = stream_text(tokenizer, ids, None)
        assert stream_text(tokenizer, ids, backend) == window, ids
        assert window[1] == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids
        text = window[1]
        if len(text) >= 4 and n % 2 == 0:  # a stop string from the text, and one that never comes
            start = rng.randrange(len(text) - 2)
            stop = (text[start : start + rng.randrange(1, 4)], "\x00never")
            skip = frozenset(rng.sample(ids, 1))
            windowed = stream_text(tokenizer, ids, None, stop, skip)
            assert stream_text(tokenizer, ids, backend, stop, skip) == windowed, (ids, stop)


def test_the_demo_models_tokenizer(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert_decoders_agree(tokenizer, 600)


def test_a_byte_level_tokenizer_one_token_per_byte() -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    assert_decoders_agree(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>"), 600)


def test_the_stream_is_not_chosen_where_it_might_differ() -> None:
    vocab = {"[UNK]": 0, "a": 1, "##b": 2, ".": 3}
    word_piece = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    word_piece.decoder = decoders.WordPiece()  # joins "##" pieces and cleans up spaces: not per token
    assert stream_decoding(PreTrainedTokenizerFast(tokenizer_object=word_piece)) is None

    class CustomDecode(PreTrainedTokenizerFast):
        def _decode(self, *args: Any, **kwargs: Any) -> str:
            return "custom"

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.decoder = decoders.ByteLevel()
    assert stream_decoding(CustomDecode(tokenizer_object=byte_level)) is None
    assert stream_decoding(PreTrainedTokenizerFast(tokenizer_object=byte_level)) is not None


def test_a_stream_that_reports_a_bad_prefix_hands_over_to_the_window() -> None:
    """DecodeStream raises where a window's text is not a prefix of the next; the Python window
    then decodes the rest of the request, as it always did."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer.encode("hello there", add_special_tokens=False)

    class Failing:  # a stream that fails at its third token
        def __init__(self) -> None:
            self.calls = 0
            self.inner = decoders.DecodeStream(skip_special_tokens=True)

        def step(self, tok: Any, token_id: int) -> str | None:
            self.calls += 1
            if self.calls == 3:
                raise Exception("Invalid prefix encountered")  # what tokenizers raises
            return self.inner.step(tok, token_id)

    detok = IncrementalDetokenizer(tokenizer, (), frozenset(), backend)
    detok._stream = Failing()
    for token_id in ids:
        detok.append(token_id)
    detok.flush()
    assert detok._stream is None and detok.text == "hello there" == detok.take_delta(True)
