"""Settings for every entry point (the services, the launcher, the engine's own tools): frozen dataclasses, one per
component, declared once and filled from defaults < `--config file.yaml` < environment (`RADIXMESH_<NAME>`) <
command-line flags. Flag names are the fields' (SGLang's names where SGLang has one); a field's metadata may add
`aliases` (more flag names) and `help`.

    parser = build_parser("what this program does", WorkerSettings, EngineArgs)   # or add_settings(own_parser, ...)
    worker_kwargs, engine_kwargs = resolve(parser.parse_args(argv), WorkerSettings, EngineArgs)
    settings, engine_kwargs = parse_settings("...", WorkerSettings, argv, EngineArgs)   # both steps, exits on error

A program that starts others (the launcher) composes their classes into its own parser and hands each child its
settings back as flags (`as_flags`). No torch import here: the router and the launcher use it without the model
stack."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, Iterable, Sequence

import yaml

ENV_PREFIX = "RADIXMESH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def field_type(cls: type, f: dataclasses.Field) -> type:
    """The scalar type of a dataclass field (`int | None` -> int)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else []
    return args[0] if args else hint


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = ()) -> None:
    """One `--field-name` flag per field of `cls` (but `skip`). Unset flags stay out of the namespace
    (argparse.SUPPRESS), so a config file or the environment can supply them; list fields take several values
    (`--worker-urls a b`)."""
    skip = frozenset(skip)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = [flag_name(f.name), *f.metadata.get("aliases", ())]
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


def _from_env(cls: type, f: dataclasses.Field, raw: str) -> Any:
    kind = field_type(cls, f)
    if kind is bool:
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected true or false")
        return low in _TRUE
    if typing.get_origin(kind) in (list, tuple):
        item = typing.get_args(kind)[0]
        return [item(x) for x in raw.replace(",", " ").split()]
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {e}") from None


def _coerce(cls: type, f: dataclasses.Field, value: Any) -> Any:
    kind = field_type(cls, f)
    if value is None:
        return None
    if typing.get_origin(kind) in (list, tuple):
        values = value.replace(",", " ").split() if isinstance(value, str) else list(value)
        return tuple(typing.get_args(kind)[0](v) for v in values)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float, str, bool) and not isinstance(value, kind):
        raise ValueError(f"setting {f.name}: expected {kind.__name__}, got {value!r}")
    return value


def add_settings(parser: argparse.ArgumentParser, *classes: type, skip: Iterable[str] = ()) -> None:
    """`--config` and every field of `classes` as a flag (a name two classes share is one flag that sets both), but
    the names in `skip`, on a parser of the caller's (a tool adds its own flags beside them)."""
    parser.add_argument("--config", help="YAML file of settings (keys as the flags, dashes or underscores)")
    seen: set[str] = set(skip)
    for cls in classes:
        add_flags(parser, cls, skip=seen)
        seen |= {f.name for f in dataclasses.fields(cls)}


def build_parser(description: str, *classes: type, skip: Iterable[str] = ()) -> argparse.ArgumentParser:
    """A parser of its own with `add_settings(parser, *classes, skip=skip)`."""
    parser = argparse.ArgumentParser(description=description,
                                     epilog=f"Every flag can also come from the environment ({ENV_PREFIX}<FLAG_NAME>)"
                                            " or from --config; flags win, then the environment, then the file.")
    add_settings(parser, *classes, skip=skip)
    return parser


def resolve(ns: argparse.Namespace, *classes: type, environ: dict | None = None,
            skip: Iterable[str] = ()) -> list[dict]:
    """Per class, the keyword arguments for it (only what was given somewhere: defaults stay the class's). Unknown
    keys in the config file, and a field without a default that nothing gave, are errors."""
    environ = os.environ if environ is None else environ
    skip = frozenset(skip)
    from_file = load_config_file(getattr(ns, "config", None))
    known = {f.name for cls in classes for f in dataclasses.fields(cls)} - skip
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) in {ns.config}: {', '.join(unknown)}")
    out = []
    for cls in classes:
        kwargs: dict = {}
        for f in dataclasses.fields(cls):
            env_key = ENV_PREFIX + f.name.upper()
            if f.name in skip:
                continue
            if f.name in vars(ns):
                kwargs[f.name] = vars(ns)[f.name]
            elif env_key in environ:
                kwargs[f.name] = _from_env(cls, f, environ[env_key])
            elif f.name in from_file:
                kwargs[f.name] = from_file[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{flag_name(f.name)} is required (on the command line, as {env_key} or in "
                                 "--config)")
            else:
                continue
            kwargs[f.name] = _coerce(cls, f, kwargs[f.name])
        out.append(kwargs)
    return out


def parse_settings(description: str, cls: type, argv: Sequence[str] | None = None, *extra: type):
    """Parse argv into an instance of `cls` (and keyword dicts for each `extra` class, e.g. EngineArgs); exits
    with the reason on a flag it does not know or a bad value."""
    parser = build_parser(description, cls, *extra)
    ns = parser.parse_args(argv)
    try:
        kwargs = resolve(ns, cls, *extra)
        return (cls(**kwargs[0]), *kwargs[1:])
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def as_flags(cls: type, values: dict) -> list[str]:
    """The command line that gives `values` (field name -> value) to a program parsing `cls`: a flag for each value
    that differs from the field's default (a default-on flag turned off is `--no-<name>`)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flags: list[str] = []
    for name, value in values.items():
        f = fields[name]
        if value == f.default or value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            flags += [flag_name(name), *map(str, value)]
        else:
            flags += [flag_name(name), str(value)]
    return flags
