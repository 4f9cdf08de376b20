"""A py-spy `record --threads --format raw` file, summed: the samples of each thread and, per thread, the functions
its samples spent most time in (inclusive: on the stack; self: at the top). With `record --gil` the samples are the
GIL's holders, so the shares say which thread of a process holds the interpreter and doing what.

    python -m radixmesh.benchmarks.spy_summary gil_worker.txt [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): ")
_LINE = re.compile(r" \(([^()]*):\d+\)$")


def parse(path: str) -> list[tuple[str, list[str], int]]:
    """(thread name, frames outermost first without line numbers, samples) per line."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread = _THREAD.sub("", frames[0])
            rows.append((thread, [_LINE.sub(r" (\1)", fr) for fr in frames[1:]], int(count)))
    return rows


def _thread_group(name: str) -> str:
    """Threads of one pool under one name (ThreadPoolExecutor-0_3 -> ThreadPoolExecutor-0_*)."""
    return re.sub(r"_\d+$", "_*", name)


def summarize(rows: list[tuple[str, list[str], int]], top: int) -> str:
    total = sum(n for _, _, n in rows) or 1
    per_thread: collections.Counter = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, n in rows:
        t = _thread_group(thread)
        per_thread[t] += n
        for fr in set(frames):
            inclusive[t][fr] += n
        if frames:
            leaf[t][frames[-1]] += n
    lines = [f"{total} samples"]
    for t, n in per_thread.most_common():
        lines.append(f"{100 * n / total:5.1f}%  {t}")
        if n / total < 0.02:
            continue
        below_root = [(fr, c) for fr, c in inclusive[t].most_common() if c < 0.9 * n]  # not the thread's root
        lines += [f"         incl {100 * c / total:5.1f}%  {fr}" for fr, c in below_root[:top]]
        lines += [f"         self {100 * c / total:5.1f}%  {fr}" for fr, c in leaf[t].most_common(top // 2)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    print(summarize(parse(args.path), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
