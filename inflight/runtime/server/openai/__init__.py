"""Everything OpenAI-shaped: the routes (``api``), request parsing (``protocol``,
``request_features``, ``tool_requests``, all reading fields with ``fields``; ``known_fields``
names the unknown ones), generation jobs and streaming (``generation``, with the prompt checks
it shares with the pooling endpoints in ``prompt_checks``; ``streaming``), response bodies (``responses``, ``echo``), chat output parsing (``chat_output``,
``chat_support``, ``tool_calls``, ``tool_stream``, ``reasoning``) and ``/tokenize``."""
