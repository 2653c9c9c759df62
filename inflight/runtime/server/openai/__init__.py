"""Everything OpenAI-shaped: the routes (``api``), request parsing (``protocol``,
``request_features``, ``tool_requests``), generation jobs and streaming (``generation``,
``streaming``), response bodies (``responses``, ``echo``), chat output parsing (``chat_output``,
``chat_support``, ``tool_calls``, ``tool_stream``, ``reasoning``) and ``/tokenize``."""
