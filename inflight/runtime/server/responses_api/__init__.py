"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) served by the chat
pipeline: a request is translated into a chat completion body (:mod:`.request`), runs through
everything /v1/chat/completions does, and its answer is rendered as a Response object or the
Responses API's stream events (:mod:`.render`); :mod:`.store` keeps finished responses for
``previous_response_id`` when the server enables it; :mod:`.routes` holds the handlers.
"""
