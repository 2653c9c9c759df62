"""The directory a server loads: the model directory, or an overlay of it for ``--tokenizer`` and
``--chat-template``.

Every loader (the engine core, the front end's tokenizer, the CLI's checks) reads one model
directory, so vLLM's ``--tokenizer DIR`` and ``--chat-template FILE|TEMPLATE`` are served as a
directory of links: the model's files, the tokenizer files of ``--tokenizer`` in place of the
model's own, and the given template as ``chat_template.jinja`` (the copy of
``tokenizer_config.json`` drops any template of its own). The overlay is built once under the
cache root (:func:`inflight.cache.cache_root`), keyed by what it is made of, and swapped in by a
rename, so a half-built one is never used. :func:`read_chat_template` reads the flag's value as
vLLM does (a file, else the template itself). Knows nothing about weights or tokenizers beyond
file names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from inflight.cache import cache_root

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", *TEMPLATE_FILES)
_JINJA_CHARS = "{}\n"


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or name.startswith("tokenizer") or name.endswith(".tiktoken")


def read_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file it names, else the value itself when it looks
    like a template (backslash escapes such as ``\\n`` decoded, as vLLM does)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template longer than a path may be
        pass
    if any(c in value for c in _JINJA_CHARS):
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    raise ValueError(f"--chat-template {value}: no such file, and it does not look like a Jinja template")


def tokenizer_dir_problem(value: str) -> str | None:
    """Why ``--tokenizer value`` cannot be used (one line), or ``None``."""
    path = Path(value)
    if path.is_dir() and any(is_tokenizer_file(p.name) for p in path.iterdir()):
        return None
    if path.is_dir():
        return f"--tokenizer {value}: the directory has no tokenizer files (tokenizer.json, tokenizer_config.json, ...)"
    hint = " (inflight never downloads: fetch it with `hf download ORG/NAME --local-dir DIR`)" if "/" in value else ""
    return f"--tokenizer {value}: no such directory{hint}"


def serving_dir(model_dir: Path, tokenizer_dir: Path | None = None, chat_template: str | None = None,
                root: Path | None = None) -> Path:
    """``model_dir`` itself, or the overlay that serves it with another tokenizer and/or template."""
    if tokenizer_dir is None and chat_template is None:
        return model_dir
    links = _links(model_dir, tokenizer_dir, chat_template is not None)
    key = json.dumps([sorted((n, str(p), *_stamp(p)) for n, p in links.items()), chat_template])
    final = (root or cache_root()) / "serving" / f"{model_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        for name, source in links.items():
            if name == "tokenizer_config.json" and chat_template is not None:
                config = json.loads(source.read_text(encoding="utf-8"))
                config.pop("chat_template", None)
                (building / name).write_text(json.dumps(config, indent=2), encoding="utf-8")
            else:
                os.symlink(source, building / name)
        if chat_template is not None:
            (building / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        os.rename(building, final)
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
        if not final.is_dir():  # not another server building the same overlay first
            raise
    return final


def _links(model_dir: Path, tokenizer_dir: Path | None, new_template: bool) -> dict[str, Path]:
    """Overlay name -> the file it links to."""
    links = {p.name: p.resolve() for p in model_dir.iterdir()
             if not (tokenizer_dir is not None and is_tokenizer_file(p.name))}
    if tokenizer_dir is not None:
        links.update({p.name: p.resolve() for p in tokenizer_dir.iterdir() if is_tokenizer_file(p.name)})
    if new_template:
        links = {n: p for n, p in links.items() if n not in TEMPLATE_FILES}
    return links


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
