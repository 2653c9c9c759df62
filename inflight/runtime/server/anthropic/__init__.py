"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) served by
the chat pipeline: a request is translated into a chat completion body (:mod:`.request`), runs
through everything /v1/chat/completions does, and its answer is rendered as an Anthropic message
or its stream events (:mod:`.render`), errors in Anthropic's shape (:mod:`.routes`).
"""
