"""Every `kvserve serve` server flag reaches its field: each set to a value of its own (no two
alike, none the default), read back from what `serve` builds from them. A flag handed to the
wrong field, or one never handed on, fails here."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from kvserve.cli import build_parser, server_args_from
from kvserve.server.app import ServerArgs
from kvserve.server.connections import ConnectionLimits
from kvserve.server.limits import RequestLimits

# fields whose flag has another name, and how the flag's text becomes the field's value
RENAMED = {"max_request_bytes": ("max_request_size", lambda n: f"{n}KiB", lambda n: n << 10)}


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _fields() -> list[str]:
    nested = {"limits", "connections"}
    return [f.name for cls in (ServerArgs, RequestLimits, ConnectionLimits)
            for f in dataclasses.fields(cls) if f.name not in nested]


def _read_back(server: ServerArgs, name: str):
    for obj in (server, server.limits, server.connections):
        if name in {f.name for f in dataclasses.fields(obj)}:
            return getattr(obj, name)
    raise AssertionError(name)


def test_every_server_flag_reaches_its_field():
    actions = {a.dest: a for a in _serve_parser()._actions}
    numbers = itertools.count(2)  # small: some limits have a ceiling (max_logprobs <= 20)
    argv, want = ["serve"], {}
    for name in _fields():
        dest, to_text, to_value = RENAMED.get(name, (name, str, None))
        action = actions.get(dest)
        assert action is not None, f"ServerArgs field {name} has no `serve` flag"
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
            want[name] = True
            continue
        if action.choices:
            value = [c for c in action.choices if c != action.default][-1]
            argv += [flag, value]
        elif action.type is float:
            value = next(numbers) + 0.5
            argv += [flag, str(value)]
        elif action.type is int:
            value = next(numbers)
            argv += [flag, str(value)]
        else:
            n = next(numbers)
            argv += [flag, to_text(n) if to_value else f"v{n}"]
            value = to_value(n) if to_value else f"v{n}"
        want[name] = value
    assert len({repr(v) for v in want.values() if v is not True}) == \
        sum(v is not True for v in want.values()), "two flags share a value: a swap would hide"
    server = server_args_from(_serve_parser().parse_args(argv[1:]))
    got = {name: _read_back(server, name) for name in want}
    assert got == want
