"""Smoke tests for the quantized-serving section without starting a server: the /proc memory
reader, the KV sizing, the llama.cpp command line, the chat stream's token counting (against a
stand-in server that answers as llama-server does) and the report."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

from aiohttp import web

from inflight.bench import chat_client, proc_memory
from inflight.bench import quant_serving as q
from inflight.bench.systems import RunningServer


def test_status_kib_and_descendants() -> None:
    assert proc_memory.status_kib("Name:\tpython\nVmRSS:\t  123456 kB\nVmHWM: 2 kB\n") == 123456
    assert proc_memory.status_kib("Rss: 10 kB\nPss:  7 kB\n", "Pss") == 7
    assert proc_memory.status_kib("Name: x\n") is None
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1}
    assert sorted(proc_memory.descendants(10, parents)) == [10, 11, 12, 13]
    assert proc_memory.descendants(99, parents) == [99]


def test_tree_memory_reads_this_process() -> None:
    procs = proc_memory.tree_memory(os.getpid())
    assert procs[0].pid == os.getpid() and procs[0].rss_kib > 0
    assert proc_memory.total_mib(procs) >= procs[0].rss_kib / 1024


def test_kv_sizing_and_llama_command(tmp_path: Path) -> None:
    assert q.context_per_sequence([35, 50], 64) == 128
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}))
    assert math.isclose(q.kv_cache_mib(tmp_path, 1024, 2), 1024 * 30 * 2 * 3 * 64 * 2 / 2**20)
    qs = q.questions(64) + q.questions(4, offset=64)
    assert len(set(qs)) == 68
    systems = q.build_systems("/bin/llama-server", tmp_path / "m.gguf", 64, 128, 2)
    assert [s.name for s in systems] == [q.PACKED, q.DEQUANT, q.LLAMA]
    assert systems[0].flags[:2] == ("--quantization", "gguf") and "8192" not in systems[0].flags
    assert systems[0].flags[systems[0].flags.index("--num-kv-blocks") + 1] == "512"
    cmd = RunningServer(systems[2], tmp_path / "m.gguf", tmp_path / "log").command()
    assert cmd[:3] == ["/bin/llama-server", "-m", str(tmp_path / "m.gguf")]
    assert cmd[cmd.index("-c") + 1] == "8192" and cmd[cmd.index("-np") + 1] == "64" and "--jinja" in cmd and "--no-repack" in cmd
    assert len(q.build_systems("", tmp_path / "m.gguf", 8, 64, 2)) == 2


async def _stream_like_llama_cpp(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [{"choices": [{"delta": {"role": "assistant"}}]},
              *({"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(3)),
              {"choices": [{"delta": {}, "finish_reason": "length"}], "timings": {"prompt_n": 9, "predicted_n": 3}}]
    for event in events:
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def test_stream_chat_counts_tokens_from_llama_cpp_timings() -> None:
    async def scenario() -> list[chat_client.ChatResult]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", _stream_like_llama_cpp)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            bodies = [chat_client.chat_body("hi", 3)] * 2
            results, _wall = await chat_client.send_chats(f"http://127.0.0.1:{port}", bodies, True)
            return results
        finally:
            await runner.cleanup()

    results = asyncio.run(scenario())
    for r in results:
        assert r.result.error is None and r.text == "t0 t1 t2 " and r.num_chunks == 3
        assert (r.result.num_prompt_tokens, r.result.num_output_tokens) == (9, 3)
        assert len(r.result.gaps_s) == 2 and r.result.tpot_s is not None


def _record(system: str, rnd: int, tok_s: float, texts: list[str]) -> q.RoundRecord:
    burst = {"output_tok_s": tok_s, "ttft_p50_s": 0.5, "ttft_p99_s": 0.9, "errors": 0.0}
    return q.RoundRecord(system, rnd, rss_warm_mib=100.0 * (1 + rnd), pss_warm_mib=80.0, rss_burst_mib=120.0,
                         tpot_b1_s=[0.01, 0.02], b1_texts=texts, burst=burst, prompt_tokens=[30, 31],
                         chunks_vs_tokens=[0], load_average=2.0)


def test_rows_ratios_and_markdown() -> None:
    records = [_record(q.PACKED, 0, 200.0, ["a", "b"]), _record(q.DEQUANT, 0, 100.0, ["a", "c"]),
               _record(q.PACKED, 1, 300.0, ["a", "b"]), _record(q.DEQUANT, 1, 100.0, ["a", "b"])]
    rows = q.system_rows(records)
    assert q.llama_kv_tokens(records) == 0
    records[0].log_facts = ["n_slots = 64, n_ctx_slot = 256, kv_unified = 'false'"]
    assert q.llama_kv_tokens(records) == 64 * 256
    assert rows[q.PACKED]["output_tok_s"].median == 250.0 and rows[q.PACKED]["rss_warm_mib"].lo == 100.0
    assert q.ratio(rows, q.PACKED, q.DEQUANT, "output_tok_s") == 2.5
    assert math.isnan(q.ratio(rows, q.PACKED, q.LLAMA, "output_tok_s"))
    notes = q.check_lines(records, 64)
    assert any("1 of 2 greedy batch-1 answers identical; the others agree for their first [0] characters" in n
               for n in notes)
    facts = {"gguf": "m.gguf", "rounds": 2, "b1_requests": 2, "burst_requests": 2, "max_tokens": 64, "ctx": 128,
             "kv_tokens": 256, "kv_mib_f32": 1.0, "llama_kv_tokens": 512, "llama_kv_mib_f16": 0.5, "cores": 2, "load_min": 2.0, "load_max": 2.0}
    md = q.quant_markdown(rows, facts, notes)
    assert f"| {q.PACKED} | 150 (100-200) |" in md and "| burst output tok/s, packed / dequantized | 2.50x |" in md
    assert "packed / llama.cpp | n/a |" in md and "### Caveat" in md
