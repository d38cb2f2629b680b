"""Running Triton kernels on CPU in a child process under ``TRITON_INTERPRET=1``.

Triton reads the variable when it is imported, so the tests that need the interpreter re-run
their own file (or a script) in a subprocess with it set and ``src`` on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def interpreter_env() -> dict[str, str]:
    """This process's environment plus TRITON_INTERPRET=1 and the checkout's src on PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return env


def run_pytest_in_interpreter(test_file: str, *args: str, timeout: float = 300) -> None:
    """Run pytest on ``test_file`` (extra ``args``, e.g. ``-m marker``) under the interpreter and
    assert that it passed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args, test_file]
    done = subprocess.run(
        cmd, env=interpreter_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
