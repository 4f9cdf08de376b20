"""RADIXMESH_TORCH_PROFILE: a torch.profiler window over chosen scheduler steps of a real engine."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from radixmesh.benchmarks import timeline
from radixmesh.engine.profiling import StepProfiler
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
    from radixmesh.engine.profiling import ProfileError

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


def test_timeline_attributes_gpu_work_to_the_step_that_launched_it():
    """benchmarks.timeline on a hand-made trace: a kernel belongs to the step whose host range holds its launch
    (through the correlation id), even when it runs after that step; work launched from another thread is counted
    apart; busy time is the union of overlapping GPU intervals."""
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = [
        x("scheduler.step", "user_annotation", 0, 100), x("extend 2 reqs 64 new", "user_annotation", 10, 50),
        x("scheduler.step", "user_annotation", 200, 100), x("decode 2 reqs", "user_annotation", 210, 20),
        x("cudaLaunchKernel", "cuda_runtime", 20, 5, correlation=1),
        x("cudaLaunchKernel", "cuda_runtime", 30, 5, correlation=2),
        x("cudaMemcpyAsync", "cuda_runtime", 220, 5, correlation=3),
        x("cudaLaunchKernel", "cuda_runtime", 50, 5, tid=2, correlation=4),  # another thread
        x("ampere_bf16_gemm_128x64", "kernel", 150, 40, tid=7, correlation=1),  # runs after its step ended
        x("_extend_kernel", "kernel", 170, 40, tid=7, correlation=2),  # overlaps the GEMM by 20
        x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 240, 10, tid=9, correlation=3),
        x("_kv_pages_kernel", "kernel", 60, 30, tid=8, correlation=4),
    ]
    res = timeline.analyse(events)
    first, second = res["steps"]
    assert first["forward"] == "extend 2 reqs 64 new" and second["forward"] == "decode 2 reqs"
    assert first["gpu_us"] == {"gemm": 40, "attention": 40} and first["gpu_busy_us"] == 60
    assert first["gpu_span_us"] == 60 and first["calls"] == {"cudaLaunchKernel": 2}
    assert second["gpu_us"] == {"memcpy_htod": 10}
    assert res["other_thread"]["gpu_us"] == {"kv_pages": 30}
    assert res["gpu_busy_us"] == 30 + 60 + 10 and res["window_us"] == 300
