"""kvserve processes for the benchmark scripts: start one and wait until /health answers 200,
stop it with SIGTERM (a clean shutdown). Imported by scripts run as `python benchmarks/X.py`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

KVSERVE = [sys.executable, "-m", "kvserve"]


def start(args: list[str], url: str, log=subprocess.DEVNULL,
          timeout: float = 300) -> subprocess.Popen:
    """`kvserve ARGS` (serve, or ray) listening at `url`, healthy on return. Refuses a URL
    where something already answers: the figures would be another server's."""
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        pass
    else:
        raise RuntimeError(f"something already answers at {url}; stop it or pick another port")
    proc = subprocess.Popen([*KVSERVE, *args], stdout=log, stderr=log)
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise RuntimeError(f"kvserve {' '.join(args)} did not become healthy at {url}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = 300) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout)
