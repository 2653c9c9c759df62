"""The step message as columns: :func:`protocol.step_done` and :meth:`StepDone.outputs` give back
every field of every output (the sparse ones present and absent), through pickle too, and the
front end's read of the columns (:meth:`OutputText.process_step_done`) hands on exactly what
:meth:`OutputText.process_step` makes of the same outputs: text, stop strings, finishes."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.output_text import OutputText
from inflight.runtime.outputs import EngineStats, RequestOutput, RequestTimes, TenantStats, TokenLogprob
from inflight.runtime.sampling_params import SamplingParams

EOS = 256
STATS = EngineStats(3, 1, 64, 9, 0, 10, 4, 10, 7, 3, 5, 4, spec_accepted_per_position=(1, 2),
                    tenants=TenantStats(("a",), (1,), (0,), (5,), (6,)), device_busy_seconds=1.5)  # fmt: skip


def _lp(token_id: int, rank: int | None = None) -> TokenLogprob:
    return TokenLogprob(token_id, -0.25 * token_id, ((token_id, -0.25), (token_id + 1, -1.5)), rank)


def _outputs() -> list[RequestOutput]:
    times = RequestTimes(1.0, 1.5, None, 3.25)
    return [
        RequestOutput("plain", (104,), "", False, None, 7, 1, 0),
        RequestOutput("two-tokens", (105, 106), "", False, None, 9, 4, 2),
        RequestOutput("no-tokens", (), "", False, None, 9, 0, 0),
        RequestOutput("logprobs", (107,), "", False, None, 3, 2, 0, new_logprobs=(_lp(107),)),
        RequestOutput("empty-logprobs", (), "", False, None, 3, 2, 0, new_logprobs=()),
        RequestOutput("prompt-logprobs", (108,), "", False, None, 3, 1, 0,
                      prompt_logprobs=(_lp(5, rank=1), _lp(6, rank=30))),  # fmt: skip
        RequestOutput("finished", (109, EOS), "", True, "stop", 4, 6, 1, times=times),
        RequestOutput("length", (110,), "", True, "length", 4, 6, 0, new_logprobs=(_lp(110),), times=times),
        RequestOutput("error", (), "", True, "error", 4, 3, 0, times=times, error="grammar refused"),
        RequestOutput("abort", (), "", True, "abort", 4, 3, 0, times=RequestTimes(2.0)),
        RequestOutput("with-text", (111,), "core text", False, None, 4, 3, 0),
        RequestOutput("odd-reason", (112,), "", False, "length", 4, 3, 0),
    ]


@pytest.mark.parametrize("pickled", [False, True], ids=["in-process", "pickled"])
def test_every_field_of_every_output_comes_back(pickled: bool) -> None:
    outputs = _outputs()
    message = p.step_done(outputs, STATS)
    if pickled:  # what Connection.send and recv do
        message = pickle.loads(bytes(ForkingPickler.dumps(message)))
    assert message.outputs() == tuple(outputs)
    assert message.stats == STATS and len(message) == len(outputs)


def test_only_rows_with_rare_fields_carry_extras() -> None:
    message = p.step_done(_outputs(), STATS)
    plain = {"plain", "two-tokens", "no-tokens"}
    assert {message.req_ids[i] for i in message.extras} == {o.req_id for o in _outputs()} - plain

    def plain_values(value: object) -> bool:  # no dataclass anywhere: the message pickles at C speed
        if isinstance(value, (tuple, list)):
            return all(plain_values(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str))

    assert plain_values((message.req_ids, message.new_token_ids, message.num_prompt_tokens, message.num_output_tokens,
                         message.num_cached_tokens, list(message.extras.values())))


def test_an_empty_step() -> None:
    message = p.step_done([], STATS)
    assert message.outputs() == () and message.extras == {}


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def _ids(tok: PreTrainedTokenizerFast, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text, add_special_tokens=False))


def test_the_columns_read_gives_what_the_outputs_read_gives() -> None:
    """Two OutputTexts, fed the same steps, one from the outputs and one from the columns."""
    tok = _byte_tokenizer()
    texts = [OutputText(tok, (EOS,)), OutputText(tok, (EOS,))]
    params = {"a": SamplingParams(stop=["STOP"]), "b": SamplingParams(), "c": SamplingParams(stop=["xy"]),
              "d": SamplingParams(logprobs=1, stop=["!"]), "e": SamplingParams(stop=["!"])}  # fmt: skip
    for text in texts:
        for req_id, sp in params.items():
            text.add(req_id, sp)
    times = RequestTimes(1.0, 2.0, 3.0, 4.0)
    steps = [
        [RequestOutput("a", _ids(tok, "hi "), "", False, None, 3, 3, 0),
         RequestOutput("b", _ids(tok, "é")[:1], "", False, None, 2, 1, 0),  # half a character
         RequestOutput("c", _ids(tok, "ax"), "", False, None, 2, 2, 1),
         RequestOutput("d", _ids(tok, "ok"), "", False, None, 2, 2, 0, new_logprobs=(_lp(1), _lp(2))),
         RequestOutput("e", _ids(tok, "x"), "", False, None, 2, 1, 0)],
        [RequestOutput("a", _ids(tok, "STOPand"), "", False, None, 3, 10, 0),  # cut at the stop
         RequestOutput("b", _ids(tok, "é")[1:] + (EOS,), "", True, "stop", 2, 3, 0, times=times),
         RequestOutput("c", _ids(tok, "yz"), "", True, "length", 2, 4, 1, times=times),  # stop in the last
         RequestOutput("d", _ids(tok, "a!b"), "", False, None, 2, 5, 0,
                       new_logprobs=(_lp(3), _lp(4), _lp(5))),
         RequestOutput("e", _ids(tok, "!"), "", False, None, 2, 2, 0)],  # one token that completes a stop  # fmt: skip
        [RequestOutput("a", _ids(tok, "late"), "", False, None, 3, 14, 0),  # finished here: dropped
         RequestOutput("unknown", (1,), "", False, None, 1, 1, 0)],
    ]
    made = []
    for step in steps:
        from_outputs = texts[0].process_step(step)
        from_columns = texts[1].process_step_done(pickle.loads(pickle.dumps(p.step_done(step, STATS))))
        assert from_columns == from_outputs
        made.append(from_columns)
    assert len(texts[0]) == len(texts[1]) == 0
    (first, none_stopped), (second, stopped), (third, _) = made
    assert none_stopped == () and stopped == ("a", "d", "e") and third == []
    assert {o.req_id: o.new_text for o in first} == {"a": "", "b": "", "c": "a", "d": "ok", "e": "x"}  # tails held back
    a, b, c, d, e = second
    assert (a.new_text, a.new_token_ids, a.finished, a.finish_reason) == ("hi ", _ids(tok, "STOP"), True, "stop")
    assert (b.new_text, b.finish_reason, b.times) == ("é", "stop", times)
    assert (c.new_text, c.new_token_ids, c.finish_reason, c.times) == ("", _ids(tok, "y"), "stop", times)
    assert (d.new_text, d.new_token_ids, d.new_logprobs) == ("a", _ids(tok, "a!"), (_lp(3), _lp(4)))
    assert (a.num_output_tokens, d.num_output_tokens) == (7, 4)
    assert (e.new_text, e.new_token_ids, e.finished, e.finish_reason, e.num_output_tokens) == ("", _ids(tok, "!"), True,
                                                                                               "stop", 2)  # fmt: skip
