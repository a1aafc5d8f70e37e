"""kvserve command line: generate | chat | serve | ray | plan | roofline | trace |
bench serve | bench soak | train-mtp | cache list | cache clear."""

from kvserve.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
