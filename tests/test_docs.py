"""The generated documentation matches the code: docs/usage.md is what the parser prints, and
docs/architecture.md's drawing of the layers is the import-linter contract. Regenerate both
with `scripts/gen_usage.py`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_usage", ROOT / "scripts" / "gen_usage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_current():
    stale = [path.name for path, text in _generator().pages().items()
             if path.read_text() != text]
    assert not stale, f"{stale} are stale: run scripts/gen_usage.py"


def test_usage_names_every_flag_of_serve():
    from tests.test_cli_wiring import _commands

    usage = (ROOT / "docs" / "usage.md").read_text()
    for action in _commands()["serve"]._actions:
        for flag in action.option_strings:
            assert flag in usage, flag
