"""The pieces of the coalesced stream without a server: a group hands its reader every queued
output at once, held outputs merge per choice (text, logprobs with their offsets, finish),
``--stream-interval`` decides when a choice is due, and the pre-rendered chunk head gives the
same bytes as rendering the whole chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from inflight.runtime.outputs import RequestOutput, TokenLogprob
from inflight.runtime.server.engine_client import RequestGroup
from inflight.runtime.server.openai import responses, streaming
from inflight.runtime.server.openai.chat_output import ChatOutputPlan, ChatStream

META = {"id": "cmpl-7", "created": 1700000000, "model": "démo"}
TEXT = {1: "a", 2: "bc", 3: "d", 4: "\ufffd"}.get


def out(req_id: str, text: str, ids: tuple[int, ...], finished: bool = False, logprobs: bool = True) -> RequestOutput:
    entries = tuple(TokenLogprob(t, -0.25 * t, ((t, -0.25 * t), (3, -2.0))) for t in ids) if logprobs else None
    return RequestOutput(req_id, ids, text, finished, "stop" if finished else None, 5, len(ids), 0, entries)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("obj", ["text_completion", "chat.completion.chunk"])
def test_chunk_format_gives_the_bytes_of_the_whole_chunk(obj: str, include_usage: bool) -> None:
    logprobs = {"tokens": ["é", "\x00"], "token_logprobs": [-0.1, float("-inf")], "top_logprobs": [{"a": -1e-300}],
                "text_offset": [0, 2]}  # fmt: skip
    for choice in ({"index": 1, "delta": {"content": "é\n\"x\""}, "logprobs": None, "finish_reason": None},
                   {"index": 0, "text": "😀 \\", "logprobs": logprobs, "finish_reason": "length"}):  # fmt: skip
        whole = {**META, "object": obj, "choices": [choice], **({"usage": None} if include_usage else {})}
        assert streaming.ChunkFormat(META, obj, include_usage).event(choice) == streaming.sse_event(whole)
        assert json.loads(streaming.sse_event(whole)[6:]) == whole


def test_held_outputs_merge_in_order_with_the_last_finish() -> None:
    held = responses.HeldDelta()
    held.add(out("r-0", "a", (1,)), 0)
    held.add(out("r-0", "", (4,)), 1)  # text held back (half a character)
    held.add(out("r-0", "bc", (2,), finished=True), 1)
    assert (held.text, held.num_tokens, held.finished, held.finish_reason) == ("abc", 3, True, "stop")
    assert [e.token_id for e in held.logprob_entries] == [1, 4, 2]
    merged = responses.completion_delta(0, held.text, held.logprob_parts, TEXT, "stop")
    one_by_one = [responses.completion_delta(0, t, [(o.new_logprobs, start)], TEXT, None)["logprobs"]
                  for t, o, start in (("a", out("r-0", "a", (1,)), 0), ("", out("r-0", "", (4,)), 1),
                                      ("bc", out("r-0", "bc", (2,)), 1))]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert merged["logprobs"][key] == [v for lp in one_by_one for v in lp[key]]
    assert merged["logprobs"]["text_offset"] == [0, 1, 1]  # each output's own start, as if sent one by one
    assert (merged["text"], merged["finish_reason"]) == ("abc", "stop")


def test_interval_holds_all_but_the_first_token_and_the_last_chunk() -> None:
    held = responses.HeldDelta()
    held.add(out("r-0", "a", (1,)), 0)
    assert held.is_due(4)  # the first token goes at once
    held.taken(sent=True)
    for i in range(3):
        held.add(out("r-0", "d", (3,)), 1 + i)
        assert held.is_due(4) is False
    held.add(out("r-0", "d", (3,)), 4)
    assert held.is_due(4) and held.text == "dddd"
    held.taken(sent=True)
    held.add(out("r-0", "d", (3,), finished=True), 5)
    assert held.is_due(4)  # the last chunk goes at once, short as it is
    nothing = responses.HeldDelta()
    nothing.add(out("r-1", "", (3,)), 0)  # tokens that said nothing yet still count for the next chunk
    nothing.taken(sent=False)
    assert (nothing.num_tokens, nothing.sent_first, nothing.text) == (1, False, "")


def test_chat_stream_fed_merged_text_gives_the_same_tool_calls() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    plan = ChatOutputPlan(tool_mode="hermes")

    def streamed(step: int) -> tuple[str, list[tuple[str, str]]]:
        stream = ChatStream(plan)
        deltas = [stream.feed(text[i:i + step], i + step >= len(text)) for i in range(0, len(text), step)]
        content = "".join(d.get("content", "") for d in deltas)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])]
        return content, calls

    assert streamed(1) == streamed(13) == streamed(len(text))
    assert streamed(1)[1] and json.loads(streamed(1)[1][0][1]) == {"city": "Paris"}


def test_group_hands_every_queued_output_in_one_batch() -> None:
    async def scenario() -> tuple[list[list[str]], list[str]]:
        group = RequestGroup(["r-0", "r-1"])
        batches: list[list[str]] = []

        async def read() -> None:
            async for batch in group.batches():
                batches.append([o.new_text for o in batch])

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)  # the reader waits
        for text in "abc":
            group.put(out("r-0", text, (1,)))  # one step's worth: the reader wakes once
        await asyncio.sleep(0)
        group.put(out("r-1", "x", (1,), finished=True))
        group.put(out("r-0", "d", (1,), finished=True))
        await asyncio.wait_for(reader, 10)
        single = RequestGroup(["r-2"])
        for text in "ef":
            single.put(out("r-2", text, (1,), finished=text == "f"))
        one_by_one = [o.new_text async for o in single]
        return batches, one_by_one

    batches, one_by_one = asyncio.run(scenario())
    assert batches == [["a", "b", "c"], ["x", "d"]]
    assert one_by_one == ["e", "f"]


def test_a_failed_group_raises_ahead_of_what_it_holds() -> None:
    async def scenario() -> None:
        group = RequestGroup(["r-0"])
        group.put(out("r-0", "a", (1,)))
        group.fail(RuntimeError("cut"))
        with pytest.raises(RuntimeError, match="cut"):
            async for _ in group.batches():
                pass
        waiting = RequestGroup(["r-1"])
        reader = asyncio.create_task(anext(aiter(waiting.batches())))
        await asyncio.sleep(0)
        waiting.fail(RuntimeError("dead"))
        with pytest.raises(RuntimeError, match="dead"):
            await asyncio.wait_for(reader, 10)
        assert waiting.unfinished == ("r-1",)

    asyncio.run(scenario())
