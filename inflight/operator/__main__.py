"""``python -m inflight.operator [kopf run options]`` = ``kopf run -m inflight.operator.kopf_main ...``.

Adds ``--all-namespaces`` when no namespace option is given, and a liveness endpoint on
``http://0.0.0.0:8080/healthz`` when none is given. Owns nothing else.
"""

from __future__ import annotations

import sys

from kopf.cli import main as kopf_main


def build_argv(args: list[str]) -> list[str]:
    """The ``kopf`` argv for the given extra options."""
    argv = ["run", "-m", "inflight.operator.kopf_main", *args]
    if not any(a in ("-A", "--all-namespaces", "-n") or a.startswith("--namespace") for a in args):
        argv.append("--all-namespaces")
    if not any(a in ("-L",) or a.startswith("--liveness") for a in args):
        argv.append("--liveness=http://0.0.0.0:8080/healthz")
    return argv


if __name__ == "__main__":
    sys.exit(kopf_main(args=build_argv(sys.argv[1:]), prog_name="python -m inflight.operator"))
