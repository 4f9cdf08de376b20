"""Command-line flags for engine arguments, named as SGLang's (`--model-path`, `--page-size`, ...), plus
`--config file.yaml` (keys in either spelling; flags given on the command line override the file)."""

from __future__ import annotations

import argparse
import dataclasses

from radixmesh.engine.config import EngineArgs
from radixmesh.engine.flags import add_dataclass_flags, load_config_file


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of engine arguments (command-line flags override it)")
    add_dataclass_flags(parser, EngineArgs)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """Engine keyword arguments from the parsed flags and the optional --config file."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    merged = load_config_file(getattr(ns, "config", None))
    merged.update({k: v for k, v in vars(ns).items() if k in names})
    unknown = sorted(set(merged) - names)
    if unknown:
        raise ValueError(f"unknown engine argument(s) in {ns.config}: {', '.join(unknown)}")
    if "model_path" not in merged:
        raise ValueError("--model-path is required (on the command line or in --config)")
    return merged
