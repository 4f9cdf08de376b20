"""Dataclass fields as command-line flags and YAML config files. No torch import: the services' settings (the
router's included) use this without loading the model stack."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

import yaml


def field_type(cls: type, field: dataclasses.Field) -> type:
    """The scalar type of a dataclass field (`int | None` -> int)."""
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else []
    return args[0] if args else hint


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset()) -> None:
    """One `--field-name` flag per field of `cls`. Unset flags stay out of the namespace (argparse.SUPPRESS), so a
    config file or the environment can supply them; list fields take several values (`--worker-urls a b`)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        # metadata "aliases": more names for the same flag (e.g. SGLang router's --request-timeout-secs)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kind = field_type(cls, f)
        common = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help")}
        if kind is bool:
            action = argparse.BooleanOptionalAction if f.default is True else "store_true"
            parser.add_argument(*flags, action=action, **common)
        elif typing.get_origin(kind) in (list, tuple):
            parser.add_argument(*flags, nargs="*", type=typing.get_args(kind)[0], **common)
        else:
            parser.add_argument(*flags, type=kind, **common)


def load_config_file(path: str | None) -> dict:
    """Keys of a YAML mapping, with dashes turned into underscores."""
    if not path:
        return {}
    with open(path) as fh:
        loaded = yaml.safe_load(fh) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of settings")
    return {k.replace("-", "_"): v for k, v in loaded.items()}
