"""Command-line flags for engine arguments, named as SGLang's (`--model-path`, `--page-size`, ...), plus
`--config file.yaml` (keys in either spelling; flags given on the command line override the file)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

import yaml

from engine.config import EngineArgs


def _flag_type(field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(EngineArgs)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else []
    return args[0] if args else hint


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of engine arguments (command-line flags override it)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(f)
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """Engine keyword arguments from the parsed flags and the optional --config file."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    merged: dict = {}
    if getattr(ns, "config", None):
        with open(ns.config) as fh:
            loaded = yaml.safe_load(fh) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{ns.config}: expected a mapping of engine arguments")
        merged.update({k.replace("-", "_"): v for k, v in loaded.items()})
    merged.update({k: v for k, v in vars(ns).items() if k in names})
    unknown = sorted(set(merged) - names)
    if unknown:
        raise ValueError(f"unknown engine argument(s) in {ns.config}: {', '.join(unknown)}")
    if "model_path" not in merged:
        raise ValueError("--model-path is required (on the command line or in --config)")
    return merged
