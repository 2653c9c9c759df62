"""Input-grounded prompts for training and measuring an EAGLE-3 head (:mod:`bench.train_eagle3`),
made offline and deterministically from texts on this machine.

Training texts come from three sources: docstrings of Python standard-library modules and
functions, the license texts and package descriptions in the virtual environment's
``*.dist-info`` folders, and short standard-library functions' source. Each is cut into passages
of a few sentences (or one function) and crossed with instruction templates that ground the
answer in the given text (summarise, repeat, rewrite, list, fix, rename, comment, ...): the
served model's greedy answers to them are the head's targets. Held-out texts come from other
sources (this repository's docs/ and the fixed texts of :mod:`bench.studies.speculative`), so a
measurement on them says how the head generalizes. Same machine, same seed: same prompts.
Knows nothing about the engine or the head.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
import warnings
from pathlib import Path

PROSE_TEMPLATES = (
    "Summarise this text in one sentence:\n\n{t}",
    "Repeat the following text exactly:\n\n{t}",
    "Rewrite this text in simpler words:\n\n{t}",
    "List the key points of this text as bullet points:\n\n{t}",
    "Copy this text and fix any mistakes:\n\n{t}",
    "Here is a text. Repeat it, then say what it is about:\n\n{t}",
    "{t}\n\nRepeat the text above word for word.",
    "Turn this text into a short numbered list of facts:\n\n{t}",
    "Give this text a title, then copy the text below the title:\n\n{t}",
    "Quote the first two sentences of this text:\n\n{t}",
    "Explain this text to a beginner:\n\n{t}",
    "Rewrite the text below in a more formal tone:\n\n{t}",
)
CODE_TEMPLATES = (
    "Copy this Python code exactly, without any change:\n\n{t}",
    "Add a comment above each line of this function and repeat it:\n\n{t}",
    "Here is a function. Repeat it, then explain it in one sentence:\n\n{t}",
    "Rewrite this function with type hints added. Keep everything else the same:\n\n{t}",
    "Explain what this code does:\n\n{t}",
    "Rename the function below to `helper` and repeat the whole function:\n\n{t}",
)
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "linecache", "locale", "logging", "lzma", "mailbox", "mimetypes",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib",
    "pprint", "profile", "pstats", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "trace", "traceback", "types", "typing", "unittest", "urllib", "uuid", "warnings", "wave",
    "weakref", "webbrowser", "xml", "zipfile", "zipimport", "zoneinfo",
)  # fmt: skip


def passages(text: str, low: int = 160, high: int = 520) -> list[str]:
    """``text``'s paragraphs joined or cut at sentence ends into passages of ``low``..``high`` characters."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if len(para) < low // 2 or para.count("|") > 2 or para.startswith(("```", ">>>", "#")):
            continue
        while len(para) > high:
            cut = para.rfind(". ", low, high)
            if cut < 0:
                break
            out.append(para[: cut + 1])
            para = para[cut + 2 :]
        if low <= len(para) <= high:
            out.append(para)
    return out


def _modules() -> list[object]:
    """The standard-library modules this Python has (deprecation noise of inspecting them silenced)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                out.append(importlib.import_module(name))
            except Exception:  # noqa: BLE001, PERF203 - a module this Python lacks: skipped
                continue
    return out


def _stdlib_docstrings() -> list[str]:
    texts: list[str] = []
    for module in _modules():
        texts += passages(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == module.__name__:
                texts += passages(inspect.getdoc(obj) or "")
    return texts


def _stdlib_functions(max_lines: int = 14) -> list[str]:
    """Short module-level functions' source (4..``max_lines`` lines, no nested defs)."""
    out: list[str] = []
    for module in _modules():
        for _, obj in sorted(vars(module).items()):
            if not (inspect.isfunction(obj) and obj.__module__ == module.__name__):
                continue
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            lines = src.splitlines()
            if 4 <= len(lines) <= max_lines and src.count("def ") == 1 and len(src) <= 600:
                out.append(src.rstrip() + "\n")
    return out


def _site_package_texts() -> list[str]:
    """Passages of the license texts and package descriptions in this environment's dist-info folders."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    texts: list[str] = []
    for info in sorted(site.glob("*.dist-info")):
        for path in sorted([*info.glob("LICENSE*"), *info.glob("licenses/*"), info / "METADATA"]):
            if path.is_file() and path.stat().st_size < 200_000:
                body = path.read_text(errors="ignore")
                if path.name == "METADATA":
                    body = body.split("\n\n", 1)[-1]  # the description after the headers
                texts += passages(body)
    return texts


def training_pairs(num: int, seed: int) -> list[tuple[str, str]]:
    """``num`` input-grounded prompts with their passages: prose passages (stdlib docstrings,
    licenses, package descriptions) and stdlib functions, each with a template drawn by ``seed``;
    distinct texts."""
    rng = random.Random(seed)
    with warnings.catch_warnings():  # inspecting every loaded module touches deprecated ones (typing.io)
        warnings.simplefilter("ignore", DeprecationWarning)
        prose = sorted(set(_stdlib_docstrings()) | set(_site_package_texts()))
        code = sorted(set(_stdlib_functions()))
    rng.shuffle(prose)
    rng.shuffle(code)
    num_code = min(num // 4, len(code))
    picked = [(rng.choice(CODE_TEMPLATES).format(t=t), t) for t in code[:num_code]]
    picked += [(rng.choice(PROSE_TEMPLATES).format(t=t), t) for t in prose[: num - len(picked)]]
    rng.shuffle(picked)
    return picked


def training_prompts(num: int, seed: int) -> list[str]:
    """The prompts of :func:`training_pairs`."""
    return [prompt for prompt, _ in training_pairs(num, seed)]


def held_out_prompts(docs: Path, num: int, seed: int) -> list[str]:
    """``num`` prompts from another source than training: passages of ``docs`` (this repository's
    docs/*.md), each with a template drawn by ``seed``."""
    rng = random.Random(seed + 1)
    texts = sorted({p for path in sorted(docs.glob("*.md")) for p in passages(path.read_text())})
    rng.shuffle(texts)
    templates = PROSE_TEMPLATES[:7]  # the ones whose answer stays close to the text
    return [rng.choice(templates).format(t=t) for t in texts[:num]]
