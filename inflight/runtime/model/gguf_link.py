"""The link from a converted GGUF directory back to its file (``source.gguf``).

The converter writes it, the GGUF resolver and the SmolLM2 fetcher refresh it, the loader reads
the file's quantized tensors through it and the quantization choice serves them packed from it.
A leaf module, so none of them import each other for it. Knows nothing about GGUF contents.
"""

from __future__ import annotations

import os
from pathlib import Path

SOURCE_LINK = "source.gguf"


def link_source(target: Path, gguf_path: Path) -> None:
    """``target/source.gguf`` -> ``gguf_path`` (as given: absolute, or relative to ``target``),
    so the engine can serve the file's packed tensors (``quantization=auto``); replaced
    atomically, since the file may have moved."""
    link = target / SOURCE_LINK
    if link.is_symlink() and link.resolve() == (target / gguf_path).resolve():
        return
    tmp = target / f".{SOURCE_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(gguf_path)
    os.replace(tmp, link)
