"""RADIXMESH_TORCH_PROFILE: a torch.profiler window over chosen scheduler steps of a real engine."""

from __future__ import annotations

import gzip
import json
import os

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


def _names(trace) -> list[str]:
    return [e.get("name", "") for e in json.load(gzip.open(trace))["traceEvents"]]


def test_start_and_stop_profile_write_a_trace_of_the_steps_between(tmp_path, monkeypatch):
    """SGLang's start_profile / stop_profile on the engine: a Chrome trace named <time>-<pid>-TP-0.trace.json.gz in
    $SGLANG_TORCH_PROFILER_DIR (the default output_dir) with the steps run between them; errors for a second start,
    a stop with nothing on, and bad options, with the engine serving on."""
    from engine.profiling import ProfileError

    monkeypatch.delenv("RADIXMESH_TORCH_PROFILE", raising=False)
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "env-dir"))
    sp = {"max_new_tokens": 5, "temperature": 0}
    with running_engine("models/tiny-llama", skip_tokenizer_init=True) as llm:
        want = llm.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"]
        with pytest.raises(ProfileError, match="not on"):
            llm.stop_profile()
        trace = llm.start_profile()
        assert trace.startswith(str(tmp_path / "env-dir")) and trace.endswith("-TP-0.trace.json.gz")
        with pytest.raises(ProfileError, match="already on"):
            llm.start_profile()
        assert llm.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"] == want
        files = llm.stop_profile()
        assert files[0] == trace and all(os.path.exists(f) for f in files)
        names = _names(trace)
        assert names.count("scheduler.step") >= 5  # the extend and four decodes at least
        assert any(n.startswith("extend 1 reqs ") for n in names)  # what the cache lacks of it
        assert llm.scheduler.profiler is None  # back to no per-step work
        # a window of num_steps closes by itself, in the output_dir asked for
        trace = llm.start_profile(output_dir=str(tmp_path / "asked"), num_steps=2, activities=["CPU"])
        llm.generate(input_ids=[9, 10, 11], sampling_params=sp)
        assert os.path.exists(trace) and _names(trace).count("scheduler.step") == 2
        with pytest.raises(ProfileError, match="not on"):
            llm.stop_profile()
        for bad, match in (({"num_steps": 0}, "num_steps"), ({"activities": ["TPU"]}, "unknown profiler activities"),
                           ({"output_dir": str(tmp_path / "a-file" / "x")}, "cannot write profiles")):
            (tmp_path / "a-file").write_text("")
            with pytest.raises(ProfileError, match=match):
                llm.start_profile(**bad)
        assert llm.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"] == want
