"""The outside clients ``make compat`` runs, each in its own virtual environment.

lm-eval, guidellm and the openai client pin things the project does not (and guidellm and
lm-eval's ``hf`` backend want torch), so none of them goes into ``.venv``. Each gets a folder
under the compat work folder (``bench/.work/compat`` by default, gitignored): a venv, torch
first where the tool needs it (through ``scripts/install_torch.py``, so the CPU build on a
machine without a GPU, exactly as ``make run`` does), then the tool at a pinned version. A
marker file per environment records the requirement it was made for; a changed pin remakes it.

Knows nothing about servers, tasks or tables.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("inflight.bench")

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_TORCH = REPO_ROOT / "scripts" / "install_torch.py"
INSTALL_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class ToolEnv:
    """One outside tool: its folder name, the requirement pip installs, whether it needs torch."""

    name: str
    requirement: str
    needs_torch: bool
    executable: str = ""  # the console script run from the env's bin/ ("" = only its python)

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1] if "==" in self.requirement else "latest"


LM_EVAL = ToolEnv("lm-eval", "lm-eval[api,hf]==0.4.13", needs_torch=True, executable="lm_eval")
GUIDELLM = ToolEnv("guidellm", "guidellm==0.8.1", needs_torch=True, executable="guidellm")
OPENAI = ToolEnv("openai", "openai==3.54.0", needs_torch=False)
TOOLS = (LM_EVAL, GUIDELLM, OPENAI)


def env_dir(work_dir: Path, tool: ToolEnv) -> Path:
    return work_dir / tool.name


def env_python(work_dir: Path, tool: ToolEnv) -> Path:
    return env_dir(work_dir, tool) / "bin" / "python"


def env_executable(work_dir: Path, tool: ToolEnv) -> Path:
    return env_dir(work_dir, tool) / "bin" / (tool.executable or "python")


def install_commands(work_dir: Path, tool: ToolEnv, base_python: str = sys.executable) -> list[list[str]]:
    """The commands that make ``tool``'s environment from nothing, in order."""
    python = str(env_python(work_dir, tool))
    commands = [[base_python, "-m", "venv", str(env_dir(work_dir, tool))],
                [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"]]
    if tool.needs_torch:
        commands.append([python, str(INSTALL_TORCH), "--python", python])
    commands.append([python, "-m", "pip", "install", "--quiet", tool.requirement])
    return commands


def _marker(work_dir: Path, tool: ToolEnv) -> Path:
    return env_dir(work_dir, tool) / ".inflight-compat-installed"


def is_installed(work_dir: Path, tool: ToolEnv) -> bool:
    marker = _marker(work_dir, tool)
    return marker.is_file() and marker.read_text().strip() == tool.requirement


def ensure_env(work_dir: Path, tool: ToolEnv) -> Path:
    """``tool``'s environment, made if missing or made for another pin; returns its folder.

    Raises RuntimeError naming the failed command and the log when an install step fails.
    """
    folder = env_dir(work_dir, tool)
    if is_installed(work_dir, tool):
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    work_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / f"{tool.name}-install.log"
    logger.info("installing %s into %s (log: %s)", tool.requirement, folder, log)
    with log.open("w") as out:
        for cmd in install_commands(work_dir, tool):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"installing {tool.requirement} failed at `{' '.join(cmd[:5])} ...` "
                                   f"(exit {done.returncode}); see {log}")
    for line in log.read_text().splitlines():
        if line.startswith(("== installed torch", "== already installed")):
            logger.info("%s: %s", tool.name, line.strip("= "))
    _marker(work_dir, tool).write_text(tool.requirement + "\n")
    return folder
