"""Cold start: the time from launching `kvserve serve` and llama-server on the same GGUF to
their first healthy /health, from a dropped page cache and from a warm one.

    python benchmarks/cold_start.py --model FILE.gguf [--rounds 5] [--kvserve-args "..."]
        [--llama-server-args "..."]

Each round starts each server twice, the order alternating round by round (both started as
benchmarks/vs_llamacpp.py starts them: `kvserve serve` with its defaults, llama-server `-t 2`):

  cold  after `sync` and dropping the kernel's page cache (/proc/sys/vm/drop_caches, which
        needs root); elsewhere only the model file's pages are dropped (posix_fadvise
        DONTNEED) and the table says so. Either way the model is read from disk again; with
        the whole cache dropped so are the server's own program and libraries (for kvserve,
        Python, torch and its kernels), as on a freshly booted or freshly scheduled machine.
  warm  right after, every file still in the page cache.

/health is polled every 10 ms; a server is stopped as soon as it answers 200. kvserve's
start-up cache (kernels, tokenizer; ~/.cache/kvserve) is kept, as a restarted server keeps
it. Printed: every start, then the medians and the median of the per-round ratios
(kvserve's time over llama-server's), with the machine's CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from vs_llamacpp import (
    Workload,
    add_beside_llama_server_args,
    beside_llama_server,
    server_spec,
)

from kvserve.bench.peers import Server, command_str, machine

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(model: Path) -> str:
    """Drops the page cache (all of it where allowed, else the model file's pages): what
    was dropped."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
        return "the whole page cache"
    except OSError:
        fd = os.open(model, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "the model file's pages only (dropping the whole page cache needs root)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_beside_llama_server_args(p, "/tmp/kvserve-cold-start")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    peers = beside_llama_server(p, args)
    names = ("kvserve", "llama-server")
    w = Workload("cold-start", "", 16, 16, 1, 1, ())
    specs = {n: server_spec(n, w, args.model, peers, args) for n in names}
    times = {(n, m): [] for n in names for m in ("cold", "warm")}
    print(f"machine: {machine()}; model {args.model.name} "
          f"({args.model.stat().st_size / 2**30:.2f} GiB)")
    for name in names:
        print(f"{name}: {command_str(specs[name].argv)}")
    dropped = ""
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        line = []
        for name in order:
            spec = specs[name]
            for mode in ("cold", "warm"):
                if mode == "cold":
                    dropped = drop_page_cache(args.model)
                server = Server(spec, args.out_dir / f"{name}.log", args.start_timeout,
                                warmup=False, poll=0.01)
                server.stop()
                t = server.healthy_after
                assert t is not None  # set when Server returns
                times[(name, mode)].append(t)
                line.append(f"{name} {mode} {t:.2f} s")
        print(f"round {r}: " + ", ".join(line), flush=True)
    print(f"\ncold: dropped {dropped}")
    med = statistics.median
    print(f"medians of {args.rounds} rounds (seconds to the first healthy /health):")
    for mode in ("cold", "warm"):
        k, ll = times[("kvserve", mode)], times[("llama-server", mode)]
        ratios = [a / b for a, b in zip(k, ll, strict=True)]
        print(f"  {mode}: kvserve {med(k):.2f} s (min {min(k):.2f}, max {max(k):.2f}), "
              f"llama-server {med(ll):.2f} s (min {min(ll):.2f}, max {max(ll):.2f}); "
              f"kvserve/llama-server {med(ratios):.2f}x (min {min(ratios):.2f}, max "
              f"{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
