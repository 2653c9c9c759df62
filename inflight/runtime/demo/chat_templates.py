"""Chat templates for the demo models: ChatML framing with each family's tool-call and
reasoning conventions, so tools and reasoning can be tested on random-weight models.

* qwen2: Hermes/Qwen tools (``<tool_call>`` JSON blocks, ``<tool_response>`` results).
* qwen3: the same plus reasoning (``<think>`` in history, ``enable_thinking=False`` closes an
  empty think block in the generation prompt, as Qwen3's own template does).
* llama: Llama 3 JSON tool calls (``{"name", "parameters"}``, results in ``ipython`` turns).
* mistral: ``[AVAILABLE_TOOLS]`` / ``[TOOL_CALLS]`` / ``[TOOL_RESULTS]``.

Without tools every template renders plain ChatML (``<|im_start|>role\\ncontent<|im_end|>``),
so requests without tools see the same prompt whatever the family. Written by us, in the
formats those families use; knows nothing about parsing (see ``server.tool_calls``).
"""

from __future__ import annotations

# ChatML framing (the demo tokenizer's <|im_start|>/<|im_end|> tokens) with each family's own
# tool-call and reasoning conventions. Messages without tools render exactly as plain ChatML.
_MSG = "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
_TOOLS_JSON = "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"


def _template(system_tools: str, assistant: str, tool_msg: str, gen_prompt: str) -> str:
    """A ChatML template: a system turn listing the tools (merged with the first system
    message), then the turns, with per-family assistant tool calls and tool results."""
    return (
        "{{ bos_token }}{% set skip_first = false %}"
        "{% if tools %}{{ '<|im_start|>system\n' }}"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% set skip_first = true %}{% endif %}"
        + system_tools + "{{ '<|im_end|>\n' }}{% endif %}"
        "{% for message in messages %}{% if not (loop.first and skip_first) %}"
        "{% if message['role'] == 'assistant' %}" + assistant +
        "{% elif message['role'] == 'tool' %}" + tool_msg +
        "{% else %}" + _MSG + "{% endif %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}" + gen_prompt + "{% endif %}"
    )


def _call(args_key: str) -> str:
    return ("{{ '{\"name\": \"' + tc['function']['name'] + '\", \"" + args_key + "\": ' "
            "+ (tc['function']['arguments'] | tojson) + '}' }}")


_HERMES_TOOLS = (
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}" + _TOOLS_JSON +
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>' }}"
)
_THINK_HISTORY = (
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}{% endif %}"
)


def _hermes_assistant(reasoning: bool) -> str:
    return (
        "{{ '<|im_start|>assistant\n' }}" + (_THINK_HISTORY if reasoning else "") +
        "{{ message['content'] or '' }}{% for tc in message.get('tool_calls') or [] %}"
        "{{ '\n<tool_call>\n' }}" + _call("arguments") + "{{ '\n</tool_call>' }}{% endfor %}"
        "{{ '<|im_end|>\n' }}"
    )


_HERMES_TOOL_MSG = "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
_GEN = "{{ '<|im_start|>assistant\n' }}"
_GEN_THINKING = _GEN + (
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)

_LLAMA3_TOOLS = (
    "{{ 'Environment: ipython\n\nGiven the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. "
    "Do not use variables.\n' }}" + _TOOLS_JSON
)
_LLAMA3_ASSISTANT = (
    "{% if message.get('tool_calls') %}{{ '<|im_start|>assistant\n' }}"
    "{% for tc in message['tool_calls'] %}{% if not loop.first %}{{ '; ' }}{% endif %}" + _call("parameters") +
    "{% endfor %}{{ '<|im_end|>\n' }}{% else %}" + _MSG + "{% endif %}"
)
_LLAMA3_TOOL_MSG = "{{ '<|im_start|>ipython\n' + message['content'] + '<|im_end|>\n' }}"

_MISTRAL_TOOLS = "{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
_MISTRAL_ASSISTANT = (
    "{% if message.get('tool_calls') %}{{ '<|im_start|>assistant\n' + (message['content'] or '') + '[TOOL_CALLS][' }}"
    "{% for tc in message['tool_calls'] %}{% if not loop.first %}{{ ', ' }}{% endif %}" + _call("arguments") +
    "{% endfor %}{{ ']<|im_end|>\n' }}{% else %}" + _MSG + "{% endif %}"
)
_MISTRAL_TOOL_MSG = "{{ '<|im_start|>tool\n[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]<|im_end|>\n' }}"

TEMPLATES = {
    "qwen2": _template(_HERMES_TOOLS, _hermes_assistant(False), _HERMES_TOOL_MSG, _GEN),
    "qwen3": _template(_HERMES_TOOLS, _hermes_assistant(True), _HERMES_TOOL_MSG, _GEN_THINKING),
    "llama": _template(_LLAMA3_TOOLS, _LLAMA3_ASSISTANT, _LLAMA3_TOOL_MSG, _GEN),
    "mistral": _template(_MISTRAL_TOOLS, _MISTRAL_ASSISTANT, _MISTRAL_TOOL_MSG, _GEN),
}


def chat_template_for(arch: str) -> str:
    """The demo chat template of ``arch`` (llama, mistral, qwen2, qwen3)."""
    try:
        return TEMPLATES[arch]
    except KeyError:
        raise ValueError(f"no demo chat template for {arch!r}; one of {', '.join(TEMPLATES)}") from None
