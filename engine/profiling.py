"""A torch.profiler window over the scheduler's steps, for kernel timelines of a live worker.

Set `RADIXMESH_TORCH_PROFILE=DIR:EXTENDS:STEPS` in a worker's environment: after the scheduler has launched EXTENDS
extend forwards (a comma-separated list gives several windows), the next STEPS steps run under torch.profiler (CPU
and CUDA activity). Each window writes `DIR/steps-<pid>-<first extend>.json.gz` (a Chrome trace: open it in
Perfetto) and `DIR/steps-<pid>-<first extend>.txt` (kernel time by name). Every step is a `scheduler.step` range,
and each forward inside it an `extend <reqs> reqs <tokens> new` or `decode <reqs> reqs` range, so the timeline reads
by step. Unset, nothing here runs: the scheduler checks one attribute per step.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from contextlib import nullcontext

import torch

log = logging.getLogger(__name__)
ENV = "RADIXMESH_TORCH_PROFILE"


class StepProfiler:
    def __init__(self, out_dir: str, starts: list[int], steps: int):
        if steps < 1 or not starts or min(starts) < 0:
            raise ValueError(f"{ENV}: want DIR:EXTENDS[,EXTENDS...]:STEPS with STEPS >= 1, got "
                             f"{out_dir}:{starts}:{steps}")
        self.out_dir, self.starts, self.steps = out_dir, sorted(set(starts)), steps
        self.prof = None
        self.left = 0
        self.first = 0

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        try:
            out_dir, starts, steps = spec.rsplit(":", 2)
            return cls(out_dir, [int(s) for s in starts.split(",")], int(steps))
        except ValueError as e:
            raise ValueError(f"{ENV}={spec!r}: want DIR:EXTENDS[,EXTENDS...]:STEPS ({e})") from None

    @property
    def active(self) -> bool:
        return self.prof is not None

    def step(self, extends_done: int):
        """Called at the top of each scheduler step: opens a window when one is due, and returns the context the
        step runs in (a `scheduler.step` range while a window is open)."""
        if self.prof is None and self.starts and extends_done >= self.starts[0]:
            self.first = self.starts.pop(0)
            self.left = self.steps
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            log.warning("torch profiler on from extend %d for %d steps", self.first, self.steps)
        if self.prof is None:
            return nullcontext()
        self.left -= 1
        return torch.profiler.record_function("scheduler.step")

    def forward(self, extend: bool, reqs: int, new_tokens: int):
        if self.prof is None:
            return nullcontext()
        return torch.profiler.record_function(f"extend {reqs} reqs {new_tokens} new" if extend
                                              else f"decode {reqs} reqs")

    def after_step(self) -> None:
        if self.prof is not None and self.left <= 0:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        base = os.path.join(self.out_dir, f"steps-{os.getpid()}-{self.first}")
        prof.export_chrome_trace(base + ".json")
        with open(base + ".json", "rb") as src, gzip.open(base + ".json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(base + ".json")
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(base + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90))
        log.warning("torch profiler window written to %s.{json.gz,txt}", base)
