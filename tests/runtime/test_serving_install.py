"""The serving install (``pip install inflight``, what ``make run`` installs) needs none of the
operator's dependencies: the server, the CLI and the model-fetch init container (which runs in
the runtime image) import and start without kopf or the Kubernetes client."""

from __future__ import annotations

import subprocess
import sys

BLOCK_OPERATOR_DEPS = "import sys; sys.modules.update(kopf=None, kubernetes=None); "


def test_serving_imports_without_the_operator_dependencies() -> None:
    code = BLOCK_OPERATOR_DEPS + (
        "import inflight.runtime.cli.command, inflight.runtime.server.app, inflight.runtime.llm, "
        "inflight.operator.model_fetch; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_blocker_really_blocks() -> None:  # the check above would pass vacuously otherwise
    proc = subprocess.run([sys.executable, "-c", BLOCK_OPERATOR_DEPS + "import inflight.operator.handlers"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "kopf" in proc.stderr
