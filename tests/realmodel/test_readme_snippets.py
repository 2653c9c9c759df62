"""The README's examples, run as a reader would, against a served SmolLM2-135M-Instruct.

Runs every ``sh`` and ``python`` block between the README's ``readme-test`` markers with the
base URL pointed at a real ``inflight serve`` process (as ``make run`` starts it), checks that
every line the README says they print appears in what they printed, and runs the offline
``LLM`` example too. A README edit that breaks an example, or changes what it prints, fails here.
``make run`` serves SmolLM2 with the template that teaches it tools (the Makefile's ``TOOL_ARGS``,
which the ``smollm2_server`` fixture passes too), so an agent framework's default request (tools,
no ``tool_choice``) is served.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from inflight.runtime.model.gguf_smollm2 import SERVED_NAME
from tests.realmodel.conftest import MAKE_RUN_TOOL_FLAGS
from tests.realmodel.helpers import REPO_ROOT, ServerProcess, http_json

README = REPO_ROOT / "README.md"
BASE_URL = "http://127.0.0.1:8000"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _marked_section() -> str:
    text = README.read_text()
    match = re.search(r"<!-- readme-test: begin.*?-->(.*?)<!-- readme-test: end -->", text, flags=re.S)
    assert match, "README.md lost its readme-test markers"
    return match.group(1)


def _promised_lines() -> list[str]:
    text = README.read_text()
    after = text[text.index("<!-- readme-test: end -->"):]
    block = re.findall(r"````text\n(.*?)````", after, flags=re.S)[0]
    return [line for line in block.splitlines() if line.strip()]


def _run(cmd: list[str], timeout: float = 180) -> str:
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd[:2]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_readme_examples_print_what_the_readme_says(smollm2_server: ServerProcess) -> None:
    section = _marked_section()
    shell, python = _blocks(section, "sh"), _blocks(section, "python")
    assert len(shell) == 1 and len(python) == 1
    outputs = [_run(["bash", "-euo", "pipefail", "-c", shell[0].replace(BASE_URL, smollm2_server.url)])]
    outputs.append(_run([sys.executable, "-c", python[0].replace(BASE_URL, smollm2_server.url)]))
    printed = "\n".join(outputs)
    print(printed)
    for line in _promised_lines():
        assert line in printed, f"README promises {line!r}; the examples printed:\n{printed}"


def test_readme_offline_example_runs(smollm2_dir: Path) -> None:
    text = README.read_text()
    offline = next(b for b in _blocks(text, "python") if "LLM(" in b)
    code = offline.replace('"models/SmolLM2-135M-Instruct"', repr(str(smollm2_dir)))
    out = _run([sys.executable, "-c", code])
    assert out.startswith(" Pacific Ocean"), out


def test_make_run_serves_the_tool_flags_the_fixture_uses() -> None:
    """The fixture stands for ``make run``: the Makefile's TOOL_ARGS are its MAKE_RUN_TOOL_FLAGS."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    lines = re.findall(r"^TOOL_ARGS\s*:?=\s*(.*)$", makefile, flags=re.M)
    assert len(lines) == 1, "the Makefile lost its TOOL_ARGS line"
    assert shlex.split(lines[0]) == MAKE_RUN_TOOL_FLAGS
    run = re.search(r"^run:.*?\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert run is not None and "$(TOOL_ARGS)" in run.group(1), "make run no longer passes $(TOOL_ARGS)"


def test_an_agent_frameworks_default_request_is_served(smollm2_server: ServerProcess) -> None:
    """What LangChain, the OpenAI Agents SDK and the like send: tools, no tool_choice (auto)."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    status, body = http_json(f"{smollm2_server.url}/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools, "max_tokens": 40, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["message"]["content"] or choice["message"].get("tool_calls"), body
