"""The ``model-fetch`` init container: download a Hugging Face repo into the model cache.

``python -m inflight.operator.model_fetch --repo-id ORG/NAME --revision REV --dest DIR
[--allow-pattern GLOB ...]`` runs in the runtime image (which has huggingface_hub) before the
runtime container starts (also once per hf LoRA adapter, with ``--expect-file
adapter_config.json``: ``render_adapters``). It downloads the matching files with ``huggingface_hub.snapshot_download``
straight into ``DIR`` (the directory the runtime is given as ``--model``), checks that a
``config.json`` arrived, and writes a marker file last. A pod that finds the marker for the
same repo and revision starts without contacting the Hub, so a scale-up or restart on a
shared cache PVC does not download again. The Hub token comes from ``HF_TOKEN`` (a Secret,
set by the operator) and the endpoint from ``HF_ENDPOINT`` (mirrors, and the tests' local
fake hub); the token is never printed.

Knows nothing about Kubernetes; imports huggingface_hub only when it runs, so the operator
image (which does not have it) can import the package.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from inflight.operator import fields
from inflight.operator.model_source import HfSource

MARKER = ".inflight-fetch.json"


@dataclass(frozen=True, slots=True)
class FetchResult:
    dest: pathlib.Path
    commit: str | None
    cached: bool  # True: the marker was there, nothing was downloaded
    files: tuple[str, ...]


def _marker_matches(dest: pathlib.Path, repo_id: str, revision: str) -> str | None:
    """The cached commit when ``dest`` holds a finished download of ``repo_id@revision``."""
    try:
        data = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if data.get("repo_id") == repo_id and data.get("revision") == revision:
        return data.get("commit") or ""
    return None


def fetch(repo_id: str, revision: str, dest: pathlib.Path, allow_patterns: Sequence[str],
          expect_file: str = "config.json") -> FetchResult:
    """Download (or find in the cache) ``repo_id@revision`` into ``dest``; ``expect_file`` must
    arrive (``config.json`` for a model, ``adapter_config.json`` for a LoRA adapter)."""
    cached = _marker_matches(dest, repo_id, revision)
    if cached is not None:
        return FetchResult(dest, cached or None, True, _listing(dest))
    from huggingface_hub import (  # the runtime image has it; the operator's does not
        HfApi,
        snapshot_download,
    )

    dest.mkdir(parents=True, exist_ok=True)
    commit = HfApi().repo_info(repo_id, revision=revision).sha
    snapshot_download(repo_id, revision=commit or revision, local_dir=dest, allow_patterns=list(allow_patterns))
    if not (dest / expect_file).is_file():
        what = "a LoRA adapter" if expect_file == "adapter_config.json" else "a model"
        raise ValueError(
            f"{repo_id}@{revision} has no {expect_file} matching {list(allow_patterns)}: not {what} the "
            "runtime can load (check the repo id, revision and allowPatterns)."
        )
    tmp = dest / f"{MARKER}.{os.getpid()}"
    tmp.write_text(json.dumps({"repo_id": repo_id, "revision": revision, "commit": commit}))
    tmp.replace(dest / MARKER)  # last, atomically: a marker means a complete download
    return FetchResult(dest, commit, False, _listing(dest))


def _listing(dest: pathlib.Path) -> tuple[str, ...]:
    return tuple(sorted(
        str(p.relative_to(dest)) for p in dest.rglob("*")
        if p.is_file() and not p.name.startswith(MARKER) and ".cache" not in p.relative_to(dest).parts
    ))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.operator.model_fetch", description=__doc__.split("\n")[0])
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--revision", default=fields.default(HfSource, "revision"))
    parser.add_argument("--dest", required=True, type=pathlib.Path)
    parser.add_argument("--allow-pattern", action="append", dest="allow_patterns", required=True)
    parser.add_argument("--expect-file", default="config.json",
                        help="a file the download must contain (adapter_config.json for a LoRA adapter)")
    args = parser.parse_args(argv)
    try:
        result = fetch(args.repo_id, args.revision, args.dest, args.allow_patterns, args.expect_file)
    except Exception as exc:  # noqa: BLE001 - any failure: one clear line, exit non-zero (pod shows it)
        print(f"model-fetch: {args.repo_id}@{args.revision} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    how = "already in the cache" if result.cached else "downloaded"
    print(f"model-fetch: {args.repo_id}@{args.revision} (commit {result.commit or '?'}) {how}: "
          f"{len(result.files)} files in {result.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
