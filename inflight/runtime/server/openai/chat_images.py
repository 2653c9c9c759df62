"""Images in chat completions: a chat's ``image_url`` parts made into the engine's inputs.

:func:`render_with_images` renders a chat whose messages hold images: the served model must take
images (a 400 naming it otherwise), the prompt may hold at most the server's limit of them
(``--limit-mm-per-prompt``), each is loaded and checked (:mod:`inflight.runtime.multimodal.media`:
data URLs, allow-listed local files, byte and pixel bounds; a 400 naming the part), preprocessed
as the model's processor does, and its slot in the message text becomes the model's placeholder
(Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``) before the chat template runs; the
rendered prompt's placeholders are then expanded to the image's token count, and the request
carries the images as :class:`~inflight.runtime.multimodal.inputs.MultimodalInputs`. A chat without
images renders as before. Runs on the tokenizer pool, off the event loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inflight.runtime.multimodal.media import IMAGE_SLOT, MediaError, MediaLimits, check_count, load_image
from inflight.runtime.multimodal.qwen2_vl import vision_facts
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.chat_support import render_chat
from inflight.runtime.server.openai.protocol import GenerationRequest


def render_with_images(tokenizer: Any, req: GenerationRequest, limits: MediaLimits,
                       model_name: str) -> tuple[GenerationRequest, list[int]]:  # fmt: skip
    """``req`` (with its images' inputs, if any) and its prompt's token ids."""
    if not req.image_urls:
        return req, render_chat(tokenizer, req)
    facts = vision_facts(getattr(tokenizer, "name_or_path", "") or "")
    if facts is None:
        raise bad_request(f"this model ({model_name}) takes no images; send text content parts only", "messages")
    slots = sum((m.get("content") or "").count(IMAGE_SLOT) for m in req.messages or ())
    if slots != len(req.image_urls):
        raise bad_request(f"the messages hold {slots} image slots (U+FFFC) for {len(req.image_urls)} image parts; "
                          "U+FFFC may not appear in message text", "messages")  # fmt: skip
    try:
        check_count(len(req.image_urls), limits)
        images = [facts.processing.preprocess(load_image(url, limits, f"image {i}"))
                  for i, url in enumerate(req.image_urls)]  # fmt: skip
    except MediaError as exc:
        raise bad_request(str(exc), exc.param) from None
    except ValueError as exc:  # the processor's own bounds (an aspect ratio past 200)
        raise bad_request(str(exc), "messages") from None
    messages = tuple({**m, "content": m["content"].replace(IMAGE_SLOT, facts.placeholder)}
                     if isinstance(m.get("content"), str) else m for m in req.messages or ())  # fmt: skip
    ids = render_chat(tokenizer, dataclasses.replace(req, messages=messages))
    try:
        ids, mm = facts.inputs(ids, images)
    except ValueError as exc:  # placeholder tokens typed as text, or dropped by the template
        raise bad_request(str(exc), "messages") from None
    return dataclasses.replace(req, mm_inputs=mm), ids
