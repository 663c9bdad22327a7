"""Build argparse options from config dataclass fields (and their help text), and back.

Shared by the CLI and the benchmarks; no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing


def scalar_type(hint):
    """`int | None` -> int: the type argparse converts to."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str  # the config's parse names the field and its values
    return hint


def comma_list(value: str) -> tuple[str, ...]:
    """`a, b,c` -> ("a", "b", "c"): how a tuple[str, ...] field is given on the command line."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                       only: tuple[str, ...] | None = None, defaults: dict | None = None,
                       shown: dict[str, str] | None = None) -> None:
    """One `--field-name` option per dataclass field (of `only` when given), typed and documented from
    the field (plus the spellings other servers use, from the field's `aliases` metadata, and its
    allowed values from `choices`; a bool field whose metadata says `negatable: False` has no `--no-`
    form). `defaults` replaces a field's default for this command; `shown` words a default in --help
    where its value would mislead (`disagg serve`'s None: sized to the machine)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only) or dataclasses.is_dataclass(hints[f.name]):
            continue
        kind = scalar_type(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        default = (defaults or {}).get(f.name, default)
        help_text = f.metadata.get("help", "")
        if kind is bool and not f.metadata.get("negatable", True):  # a switch that only turns something on
            parser.add_argument(*flags, dest=f.name, action="store_true", default=default, help=help_text)
        elif kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(*flags, dest=f.name, type=comma_list, default=default,
                                help=f"{help_text} (default: {','.join(default) or 'none'})")
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                                help=f"{help_text} (default: {(shown or {}).get(f.name, default)})")


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    """Instantiate `cls` from parsed args (fields absent from the namespace keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
