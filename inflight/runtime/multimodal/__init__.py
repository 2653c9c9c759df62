"""Image input for vision-language models: what a chat request's images become before the engine.

inputs: the plain values a request carries (:class:`ImageItem`, :class:`MultimodalInputs`) and
the prefix-cache keys of blocks that hold image tokens; media: ``image_url`` parts (data URLs,
allow-listed local files) decoded with Pillow under size and count limits; qwen2_vl: Qwen2-VL /
Qwen2.5-VL's pixel preprocessing (resize, normalize, patchify), placeholder expansion and M-RoPE
position ids. Imports no torch and nothing from the engine's rooms: the front end, the core and
the worker all read these values (tests/test_import_graph.py). docs/vision.md.
"""
