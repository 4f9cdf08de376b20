"""RADIXMESH_TORCH_PROFILE: a torch.profiler window over chosen scheduler steps of a real engine."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import timeline
from engine.profiling import StepProfiler
from tests.engine_utils import running_engine


def test_a_window_records_the_steps_after_the_chosen_extend(tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setenv("RADIXMESH_TORCH_PROFILE", f"{out}:1:4")
    with running_engine("models/tiny-llama", skip_tokenizer_init=True) as llm:
        sp = {"max_new_tokens": 6, "temperature": 0}
        llm.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)  # extend 0 (not profiled), then decodes
        llm.generate(input_ids=[9, 10, 11], sampling_params=sp)  # extend 1 is done when the window opens
        llm.generate(input_ids=[12, 13, 14, 15, 16], sampling_params=sp)
    traces = list(out.glob("steps-*-1.json.gz"))
    assert len(traces) == 1, list(out.iterdir())
    names = [e.get("name", "") for e in json.load(gzip.open(traces[0]))["traceEvents"]]
    assert names.count("scheduler.step") == 4
    forwards = [n for n in names if n.startswith(("extend ", "decode "))]
    assert forwards and len(forwards) <= 4, forwards
    assert (out / traces[0].name.replace(".json.gz", ".txt")).read_text().strip()
    # benchmarks.timeline reads it back: a row per step, each forward in its step
    res = timeline.analyse(timeline.load(str(traces[0])))
    assert len(res["steps"]) == 4
    assert [r["forward"] for r in res["steps"] if r["forward"]] == forwards
    assert all(r["host_us"] > 0 for r in res["steps"])


def test_no_window_without_the_variable(monkeypatch):
    monkeypatch.delenv("RADIXMESH_TORCH_PROFILE", raising=False)
    assert StepProfiler.from_env() is None


@pytest.mark.parametrize("spec", ["dir", "dir:x:3", "dir:1:0", "dir::3", "dir:-1:2"])
def test_a_bad_spec_is_refused_with_the_expected_form(spec, monkeypatch):
    monkeypatch.setenv("RADIXMESH_TORCH_PROFILE", spec)
    with pytest.raises(ValueError, match="DIR:EXTENDS"):
        StepProfiler.from_env()
