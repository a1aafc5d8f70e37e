"""Settings declared once: a dataclass field made with `setting` carries everything its
command-line flag needs (help, choices, the parser of its text), so the flags are built from
the fields (`add_fields_as_flags`) and read back by name (`fields_from_flags`), and no
default or help is written twice. EngineArgs and the server's settings are declared so.

Torch-free, like everything the command line needs: it is parsed before torch loads."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import field, fields
from typing import Any


def device_arg(text: str) -> str:
    """--device as torch names it: cpu, cuda or cuda:N."""
    if re.fullmatch(r"cpu(:0)?|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def _number(text: str) -> float:
    """`text` as a float; NaN where it is none, which every range check below refuses."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (NaN refused too)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def itl_target(text: str) -> float:
    """--target-itl-ms: milliseconds > 0, or 0 / off for no step-time budget."""
    if text.strip().lower() == "off":
        return 0.0
    value = _number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not milliseconds >= 0 or 'off'")
    return value


def setting(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
            choices: Iterable[str] | None = None, metavar: str | None = None,
            flag: str | None = None, aliases: tuple[str, ...] = (), negatable: bool = False,
            cli: bool = True, secret: bool = False) -> Any:
    """A field of a settings dataclass with what its flag needs: `parse` turns the flag's
    text into the value (default: int or float by the field's type, else the text); `flag`
    names a flag that is not `--` + the field's name; `negatable` gives a bool defaulting to
    False its --no- form too; `cli=False` keeps the setting off the command line (the
    Python API's alone); `secret` keeps its value out of reports (non_defaults)."""
    return field(default=default, metadata={
        "help": help, "parse": parse, "choices": list(choices) if choices else None,
        "metavar": metavar, "flag": flag, "aliases": aliases, "negatable": negatable,
        "cli": cli, "secret": secret})


# a field's type (as its annotation reads, under `from __future__ import annotations`) ->
# the parser of its flag's text, where the type alone says it
_BY_TYPE: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "int | None": int,
                                             "float | None": float}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fields_as_flags(cls: type, group: argparse._ActionsContainer,
                        only: Iterable[str] | None = None,
                        defaults: dict[str, Any] | None = None) -> None:
    """One flag per field of dataclass `cls` declared with `setting` (all, or those named in
    `only`), with its default (or one of `defaults`, for a command whose use differs),
    help, choices and parser. A bool defaulting to False is a switch; one defaulting to True
    also gets its --no- form."""
    wanted = None if only is None else set(only)
    for f in fields(cls):
        meta = f.metadata
        if not meta.get("cli") or (wanted is not None and f.name not in wanted):
            continue
        default = (defaults or {}).get(f.name, f.default)
        kw: dict[str, Any] = {"default": default, "help": meta["help"], "dest": f.name}
        names = [meta["flag"] or flag_name(f.name), *meta["aliases"]]
        if f.type in ("bool", bool):
            negatable = default or meta["negatable"]
            kw["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
        else:
            parse = meta["parse"] or _BY_TYPE.get(str(f.type))
            if parse is not None:
                kw["type"] = parse
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if meta["metavar"]:
                kw["metavar"] = meta["metavar"]
        group.add_argument(*names, **kw)


def fields_from_flags(cls: type, ns: argparse.Namespace, **extra: Any) -> Any:
    """`cls` built from the parsed flags by field name: the fields that have a flag on this
    command (a field without one keeps its default, even where another flag shares its name,
    as the sampling --seed does EngineArgs.seed's); `extra` sets others."""
    given = {f.name: getattr(ns, f.name) for f in fields(cls)
             if f.metadata.get("cli") and hasattr(ns, f.name)}
    return cls(**{**given, **extra})


def non_defaults(obj: Any) -> dict[str, str]:
    """The settings of dataclass `obj` (and of the settings dataclasses it holds) that differ
    from their defaults, as their values print, a secret one as '***': what a start-up report
    says was asked for."""
    out: dict[str, str] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "help" not in f.metadata:  # a group of settings (the server's limits)
            out.update(non_defaults(value))
        elif value != f.default:
            out[f.name] = "***" if f.metadata.get("secret") and value else str(value)
    return out


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse a byte size such as '2GiB', '512MB', '1.5g' or a plain integer."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB, 2GiB or a byte count")
    value, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    power = " kmgt".index(unit) if unit else 0
    return int(value * base**power)


def size_arg(text: str) -> int:
    """A byte size flag (parse_size) as argparse reads it."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
