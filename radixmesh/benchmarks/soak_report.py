"""The end-of-run verdict of `python -m radixmesh.benchmarks.soak` (growth of memory and descriptors, the failure rule)
and its printed summary. The rule itself is stated in benchmarks.soak's docstring."""

from __future__ import annotations

import statistics


def thirds(samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first and the last third of `samples` (at least one sample each)."""
    k = max(1, len(samples) // 3)
    return samples[:k], samples[-k:]


def _series(samples: list[dict], name: str, key: str) -> list[float]:
    return [s["procs"][name][key] for s in samples if s["procs"].get(name)]


def _slope_per_hour(samples: list[dict], name: str) -> float | None:
    """Least-squares RSS slope (MiB/h) over the samples after the first third: the settled trend."""
    rest = samples[len(samples) // 3:]
    pts = [(s["t_s"], s["procs"][name]["rss_mib"]) for s in rest if s["procs"].get(name)]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    mt, mr = statistics.fmean(t for t, _ in pts), statistics.fmean(r for _, r in pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return round(sum((t - mt) * (r - mr) for t, r in pts) / var * 3600, 1)


def growth(samples: list[dict], max_rss_mib: float, max_rss_pct: float, max_fds: int,
           min_rss_span_s: float = 0.0) -> dict:
    """Per process of the first sample: medians of RSS (MiB) and fds over the first and last third of `samples`
    (those taken under load), their growth, the limits and whether each held. RSS is judged only when the samples
    span at least `min_rss_span_s` (a short run's RSS is still settling: allocator pools, caches); fds always.
    {} with fewer than 3 samples."""
    if len(samples) < 3:
        return {}
    first, last = thirds(samples)
    rss_judged = samples[-1]["t_s"] - samples[0]["t_s"] >= min_rss_span_s
    out = {}
    for name in samples[0]["procs"]:
        rss0, rss1 = _series(first, name, "rss_mib"), _series(last, name, "rss_mib")
        fd0, fd1 = _series(first, name, "fds"), _series(last, name, "fds")
        if not (rss0 and rss1):
            continue
        base = statistics.median(rss0)
        rss_growth = round(statistics.median(rss1) - base, 1)
        rss_limit = round(max(max_rss_mib, base * max_rss_pct / 100), 1)
        fd_growth = statistics.median(fd1) - statistics.median(fd0)
        out[name] = {"rss_first_mib": base, "rss_last_mib": statistics.median(rss1), "rss_growth_mib": rss_growth,
                     "rss_limit_mib": rss_limit, "rss_slope_mib_per_h": _slope_per_hour(samples, name),
                     "fds_first": statistics.median(fd0), "fds_last": statistics.median(fd1), "fds_growth": fd_growth,
                     "fds_limit": max_fds, "rss_judged": rss_judged,
                     "ok": (rss_growth <= rss_limit or not rss_judged) and fd_growth <= max_fds}
    return out


def verdict(result: dict) -> list[str]:
    """Why the run failed (empty when it passed)."""
    why = []
    totals, warm = result["totals"], result["warmup"]
    if totals["requests"] == 0:
        why.append("no request completed")
    if totals["failed"] or warm["failed"]:
        why.append(f"{totals['failed'] + warm['failed']} requests failed")
    if totals["invalid_outputs"] or warm["invalid_outputs"]:
        why.append(f"{totals['invalid_outputs'] + warm['invalid_outputs']} outputs were invalid")
    checks = result["checks"]
    if not checks["kv_drained"]:
        why.append("the workers' KV did not return to empty after the load drained")
    if checks["kv_free_after_flush"] is False:
        why.append("free KV != pool size after /flush_cache (leaked pages)")
    why += [f"{n}: RSS grew {g['rss_growth_mib']} MiB (limit {g['rss_limit_mib']}), fds {g['fds_growth']:+g} "
            f"(limit {g['fds_limit']})" for n, g in checks["growth"].items() if not g["ok"]]
    if checks["restarted"]:
        why.append(f"services died or restarted: {', '.join(checks['restarted'])}")
    if checks.get("mesh_exit_status") not in (None, 0):
        why.append(f"the launcher exited with status {checks['mesh_exit_status']} when stopped")
    return why


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def summary(result: dict) -> str:
    cfg, totals = result["config"], result["totals"]
    lines = [f"{' soak: ' + cfg['duration'] + ', ' + str(cfg['concurrency']) + ' clients ':=^100}",
             f"{'kind':<13}{'requests':>9}{'ok':>8}  {'errors':<30}{'p50 ms':>8}{'p90 ms':>8}{'p99 ms':>8}"
             f"{'max ms':>8}"]
    for kind, k in totals["kinds"].items():
        lat = k["latency_ms"]
        errs = ", ".join(f"{c} {n}" for c, n in k["errors"].items()) or "-"
        lines.append(f"{kind:<13}{k['requests']:>9}{k['ok']:>8}  {errs:<30}{_ms(lat['p50']):>8}{_ms(lat['p90']):>8}"
                     f"{_ms(lat['p99']):>8}{_ms(lat['max']):>8}")
    procs = list(result["samples"][0]["procs"]) if result["samples"] else []
    lines.append("")
    lines.append(f"{'t':>6}{'reqs':>7}{'fail':>6}{'p50':>7}{'p99':>7}  {'KV used per worker':<20}"
                 + "".join(f"{p[:14]:>16}" for p in procs))
    lines.append(f"{'':>6}{'':>7}{'':>6}{'ms':>7}{'ms':>7}  {'(tokens)':<20}" + f"{'RSS MiB/fds':>16}" * len(procs))
    for s in result["samples"] + ([result["final"]] if result.get("final") else []):
        r = s["requests"]
        kv = "/".join(str(w.get("used_tokens", "?")) for w in s["kv"]) if isinstance(s["kv"], list) else "?"
        cells = "".join(f"{_proc(s['procs'].get(p)):>16}" for p in procs)
        label = "end" if s is result.get("final") else f"{int(s['t_s'] // 60)}:{int(s['t_s'] % 60):02d}"
        lines.append(f"{label:>6}{r['requests']:>7}{r['failed']:>6}{_ms(r['latency_ms']['p50']):>7}"
                     f"{_ms(r['latency_ms']['p99']):>7}  {kv:<20}{cells}")
    lines.append("")
    for name, g in result["checks"]["growth"].items():
        lines.append(f"{name:<12} RSS {g['rss_first_mib']:.1f} -> {g['rss_last_mib']:.1f} MiB "
                     f"({g['rss_growth_mib']:+.1f}, limit {g['rss_limit_mib']}, slope {g['rss_slope_mib_per_h']} "
                     f"MiB/h{'' if g.get('rss_judged', True) else ', not judged: run too short'}), "
                     f"fds {g['fds_first']:g} -> {g['fds_last']:g}: {'ok' if g['ok'] else 'GROWTH'}")
    c = result["checks"]
    lines.append(f"requests {totals['requests']} (+{result['warmup']['requests']} warm-up), failed "
                 f"{totals['failed']}, invalid {totals['invalid_outputs']}; KV empty after drain: {c['kv_drained']} "
                 f"({c['drain_s']} s); free == pool after flush: {c['kv_free_after_flush']}")
    why = result["failures"]
    lines.append("PASSED" if not why else "FAILED: " + "; ".join(why))
    return "\n".join(lines + ["=" * 100])


def _proc(p: dict | None) -> str:
    return "-" if not p else f"{p['rss_mib']:.0f}/{p['fds']}"
