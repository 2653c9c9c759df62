"""An agent's tool round trip on SmolLM2-135M-Instruct, served as docs/structured-outputs.md says:
``--chat-template smollm2-tools --enable-auto-tool-choice --tool-call-parser hermes``.

These are the flags ``make run`` passes (the ``smollm2_server`` fixture, which these tests use).
The packaged template renders conversations without tools exactly as SmolLM2's own template.
SmolLM2's own template does not render tools, so served with it (no ``--chat-template``)
``tools`` with ``tool_choice`` left out would be a 400 naming ``--chat-template`` (checked on the
request's output plan, without a second server). With the packaged template the openai client runs the loop
agents run: tools with ``tool_choice`` left out (served; the 135M model answers in text rather
than calling), a call (asked for with ``tool_choice: "required"`` since the model does not call
on its own, so the round trip is deterministic), the tool's result sent back with ``tool_choice``
left out, and a final answer in text that uses the result. The doc's own example is run as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime import chat_templates
from inflight.runtime.model.gguf_smollm2 import SERVED_NAME
from tests.realmodel.helpers import REPO_ROOT, ServerProcess, http_json

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

DOC = REPO_ROOT / "docs" / "structured-outputs.md"
DOC_URL = "http://127.0.0.1:8000"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(smollm2_server: ServerProcess) -> ServerProcess:
    """SmolLM2 with the documented tool flags: ``make run``'s server (MAKE_RUN_TOOL_FLAGS)."""
    return smollm2_server


def test_without_tools_the_template_renders_as_smollm2s_own(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    packaged = Path(chat_templates.resolve("smollm2-tools")).read_text()
    conversations = [
        ASK,
        [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": "Sunny."},
         {"role": "user", "content": "And tomorrow?"}],
        [*ASK, {"role": "system", "content": "late system"}],
    ]
    for messages in conversations:
        for add in (True, False):
            own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add,
                                           chat_template=packaged) == own


def test_smollm2s_own_template_refuses_auto_tools_naming_chat_template(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from inflight.runtime.server.errors import APIError
    from inflight.runtime.server.openai.chat_support import output_plan
    from inflight.runtime.server.openai.protocol import parse_chat_request

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))  # SmolLM2's own template
    with pytest.raises(APIError) as info:
        output_plan(parse_chat_request({"messages": ASK, "tools": TOOLS}), tok, [1], None)
    assert info.value.status == 400 and info.value.param == "tools"
    assert "--chat-template" in info.value.message and "smollm2-tools" in info.value.message


def test_make_runs_server_serves_tools_without_tool_choice(tools_server: ServerProcess) -> None:
    """Served with make run's flags, the request that used to be a 400 is answered."""
    status, body = http_json(f"{tools_server.url}/v1/chat/completions", {
        "model": SERVED_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 8})
    assert status == 200, body


def test_agent_round_trip_with_the_openai_client(tools_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    greedy: dict[str, Any] = dict(model=SERVED_NAME, tools=TOOLS, temperature=0)
    # tool_choice left out (auto), as agent frameworks send it: served, no longer a 400.
    auto = client.chat.completions.create(messages=ASK, max_tokens=60, **greedy).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    reply = auto
    if not auto.message.tool_calls:  # SmolLM2-135M answers in text here: ask for the call
        reply = client.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                               **greedy).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    call = reply.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    messages: list[Any] = [*ASK, reply.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = client.chat.completions.create(messages=messages, max_tokens=60, **greedy).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "18" in final.message.content, final.message.content
    streamed = client.chat.completions.create(messages=messages, max_tokens=60, stream=True, **greedy)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == final.message.content


def _doc_example() -> tuple[str, list[str]]:
    """The doc's round-trip example and what its comments say each ``print`` shows."""
    text = DOC.read_text()
    match = re.search(r"<!-- tools-roundtrip: begin -->\s*```python\n(.*?)```\s*<!-- tools-roundtrip: end -->",
                      text, flags=re.S)
    assert match, "docs/structured-outputs.md lost its tools-roundtrip markers"
    code = match.group(1)
    return code, re.findall(r"^print\(.*\)\s+# (.+)$", code, flags=re.M)


def test_the_documented_round_trip_prints_what_the_doc_says(tools_server: ServerProcess) -> None:
    code, promised = _doc_example()
    assert len(promised) == 2 and f'"{DOC_URL}/v1"' in code
    done = subprocess.run([sys.executable, "-c", code.replace(DOC_URL, tools_server.url)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == promised, done.stdout
