"""scripts/build_native.py rebuilds the recorder when any of its source files changed, not only the one it compiles."""

import importlib.util
import os
from pathlib import Path

_SCRIPT = Path(__file__).parents[2] / "scripts" / "build_native.py"
_spec = importlib.util.spec_from_file_location("build_native", _SCRIPT)
build_native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_native)


def test_an_edit_to_an_included_file_makes_the_build_stale(tmp_path):
    source, included, out = tmp_path / "_spanrec.c", tmp_path / "_spanrec_otlp.c", tmp_path / "_spanrec.so"
    for p in (source, included, out):
        p.write_text("x")
    os.utime(source, (100, 100))
    os.utime(included, (100, 100))
    os.utime(out, (200, 200))
    assert build_native.up_to_date(out, source)
    os.utime(included, (300, 300))
    assert not build_native.up_to_date(out, source)
    os.utime(out, (300, 300))
    assert build_native.up_to_date(out, source)
    out.unlink()
    assert not build_native.up_to_date(out, source)
