"""Run a real process with stdout and/or stderr on a pseudo-terminal, as a user's shell would."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PtyResult:
    returncode: int
    terminal: str  # everything written to the terminal side
    stdout: str  # what went to a pipe instead (empty when stdout was the terminal)


def run_on_pty(argv: list[str], *, stdout_tty: bool, stderr_tty: bool, timeout_s: float = 120,
               interrupt_when: Callable[[str], bool] | None = None, env: dict | None = None) -> PtyResult:
    """Run argv to its end; with `interrupt_when`, send SIGINT once the terminal text satisfies it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env,
                            stdout=slave if stdout_tty else subprocess.PIPE,
                            stderr=slave if stderr_tty else subprocess.PIPE)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout_s
    interrupted = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal side closed it
                    break
                if not data:
                    break
                seen += data
            elif proc.poll() is not None:
                break
            if interrupt_when and not interrupted and interrupt_when(seen.decode(errors="replace")):
                proc.send_signal(signal.SIGINT)
                interrupted = True
        else:
            raise TimeoutError(f"{argv} did not finish within {timeout_s:g}s")
        out = proc.stdout.read().decode() if proc.stdout else ""
        if proc.stderr:
            proc.stderr.read()
        return PtyResult(proc.wait(timeout=timeout_s), seen.decode(errors="replace"), out)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
