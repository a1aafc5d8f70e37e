"""kvserve's command line: each command's flags and function are in the module of its kind
(generate, serve, tools); this one assembles the parser and runs the command."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kvserve.entrypoints.cli import generate, serve, tools

log = logging.getLogger("kvserve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description="LLM inference engine")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)
    from kvserve.bench.serve import add_parser as add_bench_parser  # kvserve bench serve

    add_bench_parser(sub)
    serve.add_parsers(sub)
    tools.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model_tag", None):
        if args.model not in (None, args.model_tag):
            print("kvserve: error: give the model once (positional or --model)", file=sys.stderr)
            return 2
        args.model = args.model_tag
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:
        # httpx logs every request at INFO: a client's polls alone would be several lines
        # a second
        logging.getLogger("httpx").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        log.debug("total %.2fs", time.perf_counter() - t0)
