"""Start and stop a `kvserve serve` in a process of its own, for the soak and the
side-by-side benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def spawn_server(flags: list[str], port: int, log: Path, cwd: Path | None = None,
                 python: str | os.PathLike = sys.executable, env: dict | None = None,
                 timeout: float = 600) -> subprocess.Popen:
    """`python -m kvserve serve --port PORT FLAGS` in a new session (its output to
    `log`); returns once /health answers 200, raises if it exits or times out first."""
    cmd = [str(python), "-m", "kvserve", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout:g} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to its session (a graceful stop), SIGKILL after 60 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
