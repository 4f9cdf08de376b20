"""Service settings: frozen dataclasses filled from defaults < `--config file.yaml` < environment
(`RADIXMESH_<NAME>`) < command-line flags. Flag names are SGLang's where SGLang has one."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Sequence

from radixmesh.engine.flags import add_dataclass_flags, field_type, load_config_file

ENV_PREFIX = "RADIXMESH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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


def build_parser(description: str, *classes: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     epilog=f"Every flag can also come from the environment ({ENV_PREFIX}<FLAG_NAME>)"
                                            " or from --config; flags win, then the environment, then the file.")
    parser.add_argument("--config", help="YAML file of settings (keys as the flags, dashes or underscores)")
    seen: set[str] = set()
    for cls in classes:
        add_dataclass_flags(parser, cls, skip=frozenset(seen))
        seen |= {f.name for f in dataclasses.fields(cls)}
    return parser


def resolve(ns: argparse.Namespace, *classes: type, environ: dict | None = None) -> list[dict]:
    """Per class, the keyword arguments for it. Unknown keys in the config file are an error."""
    environ = os.environ if environ is None else environ
    from_file = load_config_file(getattr(ns, "config", None))
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) in {ns.config}: {', '.join(unknown)}")
    out = []
    for cls in classes:
        kwargs: dict = {}
        for f in dataclasses.fields(cls):
            env_key = ENV_PREFIX + f.name.upper()
            if f.name in vars(ns):
                kwargs[f.name] = vars(ns)[f.name]
            elif env_key in environ:
                kwargs[f.name] = _from_env(cls, f, environ[env_key])
            elif f.name in from_file:
                kwargs[f.name] = from_file[f.name]
            else:
                continue
            kwargs[f.name] = _coerce(cls, f, kwargs[f.name])
        out.append(kwargs)
    return out


def parse_settings(description: str, cls: type, argv: Sequence[str] | None = None, *extra: type):
    """Parse argv into an instance of `cls` (and keyword dicts for each `extra` class, e.g. EngineArgs)."""
    parser = build_parser(description, cls, *extra)
    ns = parser.parse_args(argv)
    try:
        kwargs = resolve(ns, cls, *extra)
        return (cls(**kwargs[0]), *kwargs[1:])
    except (TypeError, ValueError) as e:
        parser.error(str(e))
