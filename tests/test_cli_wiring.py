"""Each setting is declared once (kvserve.settings) and reaches its field.

- Every flag of `serve` and `ray` is a field of EngineArgs, ServerArgs, one of the server's
  limit groups or ReplicaArgs (or one of the few flags the CLI keeps for itself), with the
  field's help and default; every command that takes engine flags takes them from
  EngineArgs the same way.
- Every flag set to a value of its own (no two alike, none the default) is read back from
  what `serve` (and `ray`) builds from them. A flag handed to the wrong field, or never
  handed on, fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import subprocess
import sys

import pytest

from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.cli.common import engine_args_from
from kvserve.entrypoints.cli.serve import server_args_from
from kvserve.entrypoints.ray_serve.args import ReplicaArgs
from kvserve.entrypoints.server.args import ConnectionLimits, ServerArgs
from kvserve.entrypoints.server.limits import RequestLimits

SETTINGS = (EngineArgs, ServerArgs, RequestLimits, ConnectionLimits, ReplicaArgs)
# the command line's own flags, which configure no part: the positional model name and the
# default model's install
CLI_ONLY = {"help", "model_tag", "no_download"}
# commands that take a few engine flags with a default of their own: a plan or a roofline
# of a 1 GiB cache where the engine's default depends on the device
OWN_DEFAULTS = {("plan", "kv_cache_memory"): "1GiB", ("roofline", "kv_cache_memory"): "1GiB"}
ENGINE_COMMANDS = ("serve", "ray", "generate", "chat", "plan", "roofline", "train-mtp")
# fields whose flag is not `--` + their name: a byte count given as a size ("4MiB")
RENAMED = {"max_request_bytes": "--max-request-size"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _declared() -> dict[str, dataclasses.Field]:
    """Every field with a flag, by name (no name is two settings)."""
    out: dict[str, dataclasses.Field] = {}
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            if f.name in ("limits", "connections"):
                continue
            assert "help" in f.metadata, f"{cls.__name__}.{f.name} is not made with setting()"
            if f.metadata["cli"]:
                assert f.name not in out, f"two settings are named {f.name}"
                out[f.name] = f
    return out


def test_every_flag_is_a_field_with_its_help_and_default():
    """A flag named as a setting is that setting's, with its help and default; every flag of
    `serve` is a setting's (or the CLI's own)."""
    declared = _declared()
    for command in ENGINE_COMMANDS:
        for action in _commands()[command]._actions:
            field = declared.get(action.dest)
            if field is None:
                assert command not in ("serve", "ray") or action.dest in CLI_ONLY, \
                    f"{command}'s {action.option_strings} is no setting's flag"
                continue
            assert action.help == field.metadata["help"], (command, action.dest)
            flag = RENAMED.get(action.dest, "--" + action.dest.replace("_", "-"))
            assert action.option_strings[0] == flag, (action.option_strings, action.dest)
            if action.dest != "api_key":  # $KVSERVE_API_KEY, read as the parser is built
                default = OWN_DEFAULTS.get((command, action.dest), field.default)
                assert action.default == default, (command, action.dest)


def test_every_engine_setting_is_a_flag_of_each_engine_command():
    engine = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata["cli"]}
    for command in ("serve", "ray", "generate", "chat"):
        dests = {a.dest for a in _commands()[command]._actions}
        assert engine <= dests, (command, sorted(engine - dests))


def _distinct_argv(parser: argparse.ArgumentParser, names: list[str]):
    """argv setting each named field's flag to a value of its own, and the values wanted."""
    actions = {a.dest: a for a in parser._actions}
    numbers = itertools.count(2)  # small: some limits have a ceiling (max_logprobs <= 20)
    argv, want = [], {}
    for name in names:
        action = actions[name]
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            # a switch: the side that is not the default
            argv.append(flag if not action.default else f"--no-{flag[2:]}")
            want[name] = not action.default
            continue
        if action.choices:
            value = [c for c in action.choices if c != action.default][-1]
            argv += [flag, value]
        elif name == "max_request_bytes":  # a size, given as text
            n = next(numbers)
            argv += [flag, f"{n}KiB"]
            value = n << 10
        elif name == "device":
            argv += [flag, f"cuda:{next(numbers)}"]
            value = argv[-1]
        elif action.type in (int, float) or name.endswith(("_ms", "utilization")):
            n = next(numbers)
            value = n + 0.5 if action.type is not int else n
            if name == "gpu_memory_utilization":
                value = n / 1000
            argv += [flag, str(value)]
        else:
            value = f"v{next(numbers)}"
            argv += [flag, value]
        want[name] = value
    plain = [repr(v) for v in want.values() if not isinstance(v, bool)]
    assert len(set(plain)) == len(plain), "two flags share a value: a swap would hide"
    return argv, want


@pytest.mark.parametrize("command", ["serve", "ray"])
def test_every_serve_flag_reaches_its_field(command, monkeypatch):
    parser = _commands()[command]
    names = [a.dest for a in parser._actions if a.dest in _declared()]
    argv, want = _distinct_argv(parser, names)
    if command == "ray":  # the fewest replicas is at most the most
        argv[argv.index("--min-replicas") + 1] = "1"
        want["min_replicas"] = 1
    args = parser.parse_args(argv)
    server = server_args_from(args)
    replicas = ReplicaArgs.from_cli_args(args)
    monkeypatch.setattr("kvserve.entrypoints.cli.common.ensure_default_model", lambda args: None)
    monkeypatch.setattr("kvserve.entrypoints.cli.common.prefault_weights", lambda args: None)
    engine = engine_args_from(args)
    got = {}
    for name in want:
        for obj in (engine, server, server.limits, server.connections, replicas):
            if name in {f.name for f in dataclasses.fields(obj)}:
                got[name] = getattr(obj, name)
    assert got == want


@pytest.mark.parametrize("command", ["plan", "roofline"])
def test_a_command_of_a_few_engine_flags_reads_them_into_engine_args(command):
    parser = _commands()[command]
    names = [a.dest for a in parser._actions
             if a.dest in {f.name for f in dataclasses.fields(EngineArgs)}]
    argv, want = _distinct_argv(parser, names)
    engine = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert {n: getattr(engine, n) for n in want} == want


@pytest.mark.slow
def test_kvserve_serve_reports_every_server_flag_it_was_given(tiny_llama_dir):
    """`kvserve serve` itself, with every server, request-limit and connection flag set to a
    value of its own: its start-up report names each with the value given (keys masked), so
    a flag that `serve` drops or hands to another field fails here, not only in
    test_every_serve_flag_reaches_its_field's call of the same functions."""
    serve = _commands()["serve"]
    server_fields = {f.name for cls in (ServerArgs, RequestLimits, ConnectionLimits)
                     for f in dataclasses.fields(cls) if f.name not in ("limits", "connections")}
    names = [a.dest for a in serve._actions if a.dest in server_fields]
    argv, want = _distinct_argv(serve, names)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_llama_dir), "--dtype",
         "float32", "--target-itl-ms", "0", *argv], stderr=subprocess.PIPE, text=True)
    try:
        report = next((line for line in proc.stderr if "server settings" in line), "")
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert report, "no start-up report of the server settings"
    got = dict(item.split("=", 1) for item in report.split(": ", 2)[-1].strip().split(", "))
    secret = {"api_key", "metrics_api_key"}
    assert got == {k: "***" if k in secret else str(v) for k, v in want.items()}
