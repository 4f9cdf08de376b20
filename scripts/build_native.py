"""Build the native span recorder (radixmesh/services/common/_spanrec.c) beside its source, for this interpreter:
`python scripts/build_native.py`. `make` runs it; without it the Python recorder is used (slower, the same spans).
Exits non-zero when the compiler fails, with its message."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# #includes the other _spanrec_*.c (one translation unit)
SOURCE = ROOT / "radixmesh" / "services" / "common" / "_spanrec.c"


def target() -> Path:
    return SOURCE.with_name("_spanrec" + sysconfig.get_config_var("EXT_SUFFIX"))


def up_to_date(out: Path, source: Path = SOURCE) -> bool:
    """Whether `out` was built after every source file of the recorder (`source` and the files beside it that it
    #includes, named after it)."""
    newest = max(p.stat().st_mtime for p in source.parent.glob(source.stem + "*.c"))
    return out.exists() and out.stat().st_mtime >= newest


def main() -> int:
    out = target()
    if up_to_date(out):
        return 0
    cc = os.environ.get("CC") or "cc"
    tmp = out.with_name(out.name + ".tmp")
    cmd = [cc, "-O2", "-fPIC", "-shared", "-Wall", "-Wno-missing-braces", "-fno-strict-aliasing",
           f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(tmp), "-lpthread"]
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        print(f"building {out.name} failed (exit {done.returncode})", file=sys.stderr)
        return done.returncode
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
