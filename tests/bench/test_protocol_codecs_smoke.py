"""The codec bench's msgspec twins still carry every field of the step message: each codec
round-trips a ``StepDone`` (with and without logprobs) back to an equal value. No timing."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")  # the bench extra

from bench.studies import protocol_codecs as pc  # noqa: E402


@pytest.mark.parametrize("top_logprobs", [None, 5])
def test_every_codec_round_trips_the_step_message(top_logprobs: int | None) -> None:
    message = pc.step_message(8, top_logprobs)
    for name, (prepare, encode, decode) in pc.codecs().items():
        back = decode(encode(prepare(message)))
        assert (back if isinstance(back, pc.p.StepDone) else pc.from_struct(back)) == message, name


def test_the_report_renders() -> None:
    text = pc.render(pc.measure(loops=1, repeats=1), {"protocol_ms_per_step": 0.4, "engine_step_ms": 20.0})
    assert "pickle (today)" in text and "msgspec structs" in text and "0.400 ms" in text
