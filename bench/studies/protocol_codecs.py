"""``python -m bench.studies.protocol_codecs``: the step message's codec, pickle against msgspec.

Times encode + decode (in one process: the codec alone, no pipe, no socket) of a realistic
:class:`~inflight.runtime.engine_core.protocol.StepDone`: 64 running sequences, one new token
each, token ids only (the core does not detokenize), with the step's stats; once without
logprobs and once with 5 alternatives per token. Codecs:

* ``pickle``: what the protocol uses (``multiprocessing``'s ``ForkingPickler``, as
  ``Connection.send`` does), dataclasses in and out;
* ``msgspec structs``: ``msgspec.msgpack`` on ``msgspec.Struct`` twins of the messages
  (``array_like``, as vLLM's ``EngineCoreOutputs`` are), the cost if the protocol's types
  became Structs;
* ``msgspec structs + conversion``: the same, plus converting our dataclasses to the twins and
  back, the cost of switching the codec alone;
* ``msgspec tuples``: ``msgspec.msgpack`` on plain nested tuples (decoded untyped), with the
  conversion from and back to the dataclasses.

Writes ``protocol_codecs.md`` / ``.json``; reads the protocol cost per step and the engine step
from ``process_split.json`` when there is one, to put the figures in proportion. Knows the
protocol's types, nothing of processes or pipes.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import msgspec

from inflight.bench import report
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.outputs import EngineStats, RequestOutput, TokenLogprob

NUM_SEQS = 64
TOP_LOGPROBS = 5


# ---- msgspec twins of the step message (array_like: field names are not sent) -------------


class TokenLogprobS(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


class RequestOutputS(msgspec.Struct, array_like=True, frozen=True):
    req_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: tuple[TokenLogprobS, ...] | None = None
    times: tuple[float | None, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobS, ...] | None = None
    error: str | None = None


class EngineStatsS(msgspec.Struct, array_like=True, frozen=True):
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_tokens_last_step: int
    num_steps: int
    max_num_sequences: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    tenants: None = None  # fair policy only; off in this message


class StepDoneS(msgspec.Struct, array_like=True, frozen=True):
    outputs: tuple[RequestOutputS, ...]
    stats: EngineStatsS


# ---- the message ------------------------------------------------------------------------


def step_message(num_seqs: int, top_logprobs: int | None) -> p.StepDone:
    """One decode step's outputs as the core sends them (token ids only, no text, no times)."""
    def logprobs(i: int) -> tuple[TokenLogprob, ...] | None:
        if top_logprobs is None:
            return None
        top = tuple((2000 + i + k, -0.5 - 0.37 * k) for k in range(top_logprobs))
        return (TokenLogprob(1000 + i, -0.5 - 0.01 * i, top),)

    outputs = tuple(RequestOutput(f"cmpl-{i:08x}-0", (1000 + i,), "", False, None, 96, 40 + i, 0, logprobs(i))
                    for i in range(num_seqs))  # fmt: skip
    stats = EngineStats(num_seqs, 0, 4096, 900, 0, 6144, 2560, 6144, 2560 + num_seqs, num_seqs, 100, 256)
    return p.step_done(outputs, stats)


def _lp_to_s(lps: tuple[TokenLogprob, ...] | None) -> tuple[TokenLogprobS, ...] | None:
    return None if lps is None else tuple(TokenLogprobS(x.token_id, x.logprob, x.top, x.rank) for x in lps)


def _lp_from_s(lps: tuple[TokenLogprobS, ...] | None) -> tuple[TokenLogprob, ...] | None:
    return None if lps is None else tuple(TokenLogprob(x.token_id, x.logprob, x.top, x.rank) for x in lps)


def to_struct(m: p.StepDone) -> StepDoneS:
    s = m.stats
    stats = EngineStatsS(*(getattr(s, f) for f in EngineStatsS.__struct_fields__[:-1]))
    outputs = tuple(RequestOutputS(o.req_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                                   o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens,
                                   _lp_to_s(o.new_logprobs), None, _lp_to_s(o.prompt_logprobs), o.error)
                    for o in m.outputs())  # fmt: skip
    return StepDoneS(outputs, stats)


def from_struct(m: StepDoneS) -> p.StepDone:
    stats = EngineStats(*(getattr(m.stats, f) for f in EngineStatsS.__struct_fields__[:-1]))
    outputs = tuple(RequestOutput(o.req_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                                  o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens,
                                  _lp_from_s(o.new_logprobs), None, _lp_from_s(o.prompt_logprobs), o.error)
                    for o in m.outputs)  # fmt: skip
    return p.step_done(outputs, stats)


def to_tuples(m: p.StepDone) -> tuple[Any, ...]:
    def lps(x: tuple[TokenLogprob, ...] | None) -> Any:
        return None if x is None else tuple((t.token_id, t.logprob, t.top, t.rank) for t in x)

    outputs = tuple((o.req_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.num_prompt_tokens,
                     o.num_output_tokens, o.num_cached_tokens, lps(o.new_logprobs), lps(o.prompt_logprobs), o.error)
                    for o in m.outputs())  # fmt: skip
    s = m.stats
    return outputs, tuple(getattr(s, f) for f in EngineStatsS.__struct_fields__[:-1])


def from_tuples(raw: Any) -> p.StepDone:
    def lps(x: Any) -> tuple[TokenLogprob, ...] | None:
        if x is None:
            return None
        return tuple(TokenLogprob(t[0], t[1], tuple(tuple(a) for a in t[2]), t[3]) for t in x)

    outputs, stats = raw
    return p.step_done(tuple(RequestOutput(o[0], tuple(o[1]), o[2], o[3], o[4], o[5], o[6], o[7], lps(o[8]), None,
                                           lps(o[9]), o[10]) for o in outputs),
                       EngineStats(*stats[:15], tuple(stats[15])))  # fmt: skip


# ---- the codecs ----------------------------------------------------------------------------


def codecs() -> dict[str, tuple[Callable[[p.StepDone], Any], Callable[[Any], Any], Callable[[Any], Any]]]:
    """name -> (prepare the message once, encode, decode); the round trip is encode + decode."""
    enc = msgspec.msgpack.Encoder()
    dec_struct = msgspec.msgpack.Decoder(StepDoneS)
    dec_any = msgspec.msgpack.Decoder()
    return {
        "pickle (today)": (lambda m: m, lambda m: bytes(ForkingPickler.dumps(m)), pickle.loads),
        "msgspec structs": (to_struct, enc.encode, dec_struct.decode),
        "msgspec structs + conversion": (lambda m: m, lambda m: enc.encode(to_struct(m)),
                                         lambda b: from_struct(dec_struct.decode(b))),
        "msgspec tuples + conversion": (lambda m: m, lambda m: enc.encode(to_tuples(m)),
                                        lambda b: from_tuples(dec_any.decode(b))),
    }  # fmt: skip


def _best_us(fn: Callable[[], Any], loops: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean microseconds of ``loops`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - t0) / loops)
    return 1e6 * statistics.median(times)


def measure(loops: int = 200, repeats: int = 15) -> list[dict[str, Any]]:
    """Encode and decode microseconds and bytes per codec, with and without logprobs."""
    rows = []
    for label, top in (("no logprobs", None), (f"{TOP_LOGPROBS} logprobs", TOP_LOGPROBS)):
        message = step_message(NUM_SEQS, top)
        for name, (prepare, encode, decode) in codecs().items():
            value = prepare(message)
            blob = encode(value)
            back = decode(blob)
            if name.endswith("conversion") or name.startswith("pickle"):
                assert back == message, f"{name} does not round-trip the message"
            rows.append({"message": label, "codec": name, "bytes": len(blob),
                         "encode_us": _best_us(lambda e=encode, v=value: e(v), loops, repeats),
                         "decode_us": _best_us(lambda d=decode, b=blob: d(b), loops, repeats)})  # fmt: skip
    return rows


def render(rows: list[dict[str, Any]], split: dict[str, Any] | None) -> str:
    table = report.simple_table(
        ["message", "codec", "bytes", "encode µs", "decode µs", "round trip µs", "vs pickle"],
        [[r["message"], r["codec"], r["bytes"], f"{r['encode_us']:.0f}", f"{r['decode_us']:.0f}",
          f"{r['encode_us'] + r['decode_us']:.0f}",
          f"{_ratio(rows, r):.2f}x"] for r in rows],
    )  # fmt: skip
    context = ""
    if split is not None:
        context = (f"\nFrom `process_split.json`: the whole protocol (pickle, pipe, wake-up, unpickle) costs "
                   f"{split['protocol_ms_per_step']:.3f} ms per {NUM_SEQS}-sequence step, against an engine "
                   f"step of {split['engine_step_ms']:.1f} ms.\n")  # fmt: skip
    return (f"# Step-message codecs: pickle vs msgspec\n\nOne `StepDone` of {NUM_SEQS} sequences, one new token "
            f"each (token ids only, the step's stats), encoded and decoded in one process: the codec alone, no "
            f"pipe. Median of repeats of the mean of many calls; µs per message; msgspec {msgspec.__version__}, "
            f"load average {os.getloadavg()[0]:.1f} at the end of the run.\n\n{table}\n{context}")


def _ratio(rows: list[dict[str, Any]], row: dict[str, Any]) -> float:
    base = next(r for r in rows if r["message"] == row["message"] and r["codec"].startswith("pickle"))
    return (row["encode_us"] + row["decode_us"]) / (base["encode_us"] + base["decode_us"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.protocol_codecs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    rows = measure(args.loops, args.repeats)
    split_path = args.results_dir / "process_split.json"
    split = json.loads(split_path.read_text()) if split_path.exists() else None
    text = render(rows, split)
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "protocol_codecs.md").write_text(text)
    report.write_json(args.results_dir / "protocol_codecs.json", {"num_seqs": NUM_SEQS, "rows": rows,
                                                                  "msgspec": msgspec.__version__})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
