"""Tool-call parsers of the formats current models write, one module per format.

* :mod:`.common`: the values every parser returns (``ToolCall``, ``ParsedOutput``), the one JSON
  rendering of arguments (compact, as OpenAI returns them), and the tool schemas' parameter types.
* :mod:`.blocks`: one streaming scanner for formats whose calls sit between begin/end markers,
  used whole (non-streamed) and delta by delta (streamed), so both give the same calls.
* :mod:`.qwen3_coder`, :mod:`.glm45`, :mod:`.deepseek` (v3, v31), :mod:`.kimi_k2`: those formats.
* :mod:`.pythonic`: ``[f(a=1), g()]`` read with ``ast`` (never evaluated).
* :mod:`.harmony`: gpt-oss's channels (analysis -> reasoning, final -> content, ``to=functions.x``
  -> a call).

The hermes, llama3_json and mistral parsers live in ``openai.tool_calls`` (the entry point that
picks a format by name). Knows nothing about HTTP, the engine or tokenizers.
"""
