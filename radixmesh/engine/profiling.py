"""torch.profiler windows over the scheduler's steps: kernel timelines of a live worker.

Two ways to open one:
- SGLang's: `/start_profile` (the router fans it out to every worker; `Engine.start_profile` offline) opens a window
  now, for `num_steps` steps or until `/stop_profile`. It writes `<output_dir>/<unix time>-<pid>-TP-0.trace.json.gz`
  (SGLang's name with the process id: a mesh's workers may share a machine), where output_dir defaults to
  $SGLANG_TORCH_PROFILER_DIR, else /tmp.
- For benchmarks that cannot send a request at the right moment: `RADIXMESH_TORCH_PROFILE=DIR:EXTENDS:STEPS` in a
  worker's environment opens a window of STEPS steps after the scheduler has launched EXTENDS extend forwards
  (several, comma-separated). Each writes `DIR/steps-<pid>-<first extend>.json.gz`.
Each window also writes a `.txt` table of kernel time by name beside its trace (Perfetto opens the trace). Every
step is a `scheduler.step` range, and each forward inside it an `extend <reqs> reqs <tokens> new` or
`decode <reqs> reqs` range, so `benchmarks.timeline` can read the trace by step. With no window open or due, the
scheduler checks one attribute per step and nothing here runs.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
from contextlib import nullcontext

import torch

log = logging.getLogger(__name__)
ENV = "RADIXMESH_TORCH_PROFILE"
DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"  # SGLang's: where /start_profile's traces go by default
ACTIVITIES = ("CPU", "GPU")  # SGLang's names for torch.profiler's CPU and CUDA activities


class ProfileError(ValueError):
    """A profiling request that cannot be honoured; the message says why. `state`: refused for the profiler's state
    (a window already on, or none on), not for the request's options."""

    def __init__(self, message: str, state: bool = False):
        super().__init__(message)
        self.state = state


class StepProfiler:
    def __init__(self, out_dir: str = "", starts: list[int] | None = None, steps: int = 0):
        """`starts`/`steps`: the windows RADIXMESH_TORCH_PROFILE asks for (none: only windows opened by `start`)."""
        starts = list(starts or [])
        if starts and (steps < 1 or min(starts) < 0):
            raise ValueError(f"{ENV}: want DIR:EXTENDS[,EXTENDS...]:STEPS with STEPS >= 1, got "
                             f"{out_dir}:{starts}:{steps}")
        self.out_dir, self.starts, self.steps = out_dir, sorted(set(starts)), steps
        self.prof = None
        self.left: int | None = 0  # steps the open window still runs (None: until stop)
        self.base, self.suffix = "", ""  # the open window's output path, and its trace's suffix

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

    @property
    def idle(self) -> bool:
        """No window open and none due."""
        return self.prof is None and not self.starts

    def start(self, output_dir: str | None = None, num_steps: int | None = None,
              activities: list[str] | None = None, with_stack: bool = False, record_shapes: bool = False) -> str:
        """Open a window now (SGLang's /start_profile). Returns the trace file it will write."""
        if self.prof is not None:
            raise ProfileError("profiling is already on: stop it first (/stop_profile)", state=True)
        if num_steps is not None and num_steps < 1:
            raise ProfileError(f"num_steps must be >= 1, got {num_steps}")
        unknown = sorted(set(activities or ()) - set(ACTIVITIES))
        if unknown:
            raise ProfileError(f"unknown profiler activities {unknown}: use {list(ACTIVITIES)}")
        out_dir = output_dir or os.environ.get(DIR_ENV) or "/tmp"
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise ProfileError(f"cannot write profiles to {out_dir!r}: {e.strerror or e}") from None
        if not os.access(out_dir, os.W_OK):
            raise ProfileError(f"cannot write profiles to {out_dir!r}: not writable")
        # SGLang's <time>-TP-<rank> with the process id: the workers of a mesh may share a machine and a directory
        stamp = f"{time.time():.0f}-{os.getpid()}"
        base, n = os.path.join(out_dir, f"{stamp}-TP-0"), 0
        while os.path.exists(base + ".trace.json.gz"):  # a second window in the same second
            n += 1
            base = os.path.join(out_dir, f"{stamp}.{n}-TP-0")
        self._open(base, ".trace.json.gz", num_steps, activities or list(ACTIVITIES), with_stack, record_shapes)
        return base + ".trace.json.gz"

    def stop(self) -> list[str]:
        """Close the open window (SGLang's /stop_profile); returns the files written."""
        if self.prof is None:
            raise ProfileError("profiling is not on (/start_profile starts it)", state=True)
        return self.close()

    def _open(self, base: str, suffix: str, steps: int | None, activities: list[str], with_stack: bool = False,
              record_shapes: bool = False) -> None:
        acts = []
        if "CPU" in activities:
            acts.append(torch.profiler.ProfilerActivity.CPU)
        if "GPU" in activities and torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, with_stack=with_stack, record_shapes=record_shapes)
        self.prof.__enter__()
        self.left, self.base, self.suffix = steps, base, suffix
        log.warning("torch profiler on (%s), writing %s", f"{steps} steps" if steps else "until stopped", base)

    def step(self, extends_done: int):
        """Called at the top of each scheduler step: opens a window when one is due, and returns the context the
        step runs in (a `scheduler.step` range while a window is open)."""
        if self.prof is None and self.starts and extends_done >= self.starts[0]:
            first = self.starts.pop(0)
            os.makedirs(self.out_dir, exist_ok=True)
            self._open(os.path.join(self.out_dir, f"steps-{os.getpid()}-{first}"), ".json.gz", self.steps,
                       list(ACTIVITIES))
        if self.prof is None:
            return nullcontext()
        if self.left is not None:
            self.left -= 1
        return torch.profiler.record_function("scheduler.step")

    def forward(self, extend: bool, reqs: int, new_tokens: int):
        if self.prof is None:
            return nullcontext()
        return torch.profiler.record_function(f"extend {reqs} reqs {new_tokens} new" if extend
                                              else f"decode {reqs} reqs")

    def after_step(self) -> None:
        if self.prof is not None and self.left is not None and self.left <= 0:
            self.close()

    def close(self) -> list[str]:
        """Write the open window's files (none open: nothing) and return their paths."""
        if self.prof is None:
            return []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        base = self.base
        trace = base + self.suffix
        prof.export_chrome_trace(base + ".json")
        with open(base + ".json", "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(base + ".json")
        on_gpu = any(a == torch.profiler.ProfilerActivity.CUDA for a in prof.activities)
        key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        with open(base + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90))
        log.warning("torch profiler window written to %s", trace)
        return [trace, base + ".txt"]
