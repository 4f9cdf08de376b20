"""Print the project's runtime requirements (pyproject.toml's dependencies plus the named extras), one per line,
without torch, which the images install first from a wheel index of their own (CPU or CUDA).

  python3 requirements.py pyproject.toml [extra ...] > requirements.txt

Reading only pyproject.toml lets the image cache its dependency layer until the dependencies change, whatever else
in the tree does."""

from __future__ import annotations

import re
import sys
import tomllib

SKIP = {"torch"}  # installed beforehand, from the matching wheel index


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) in {pyproject}: {', '.join(unknown)}")
    reqs = [*project["dependencies"], *(r for e in extras for r in optional[e])]
    name = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    return [r for r in dict.fromkeys(reqs) if name.match(r).group(1).lower() not in SKIP]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
