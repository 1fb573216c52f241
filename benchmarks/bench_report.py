"""Aggregation of per-rank records, and the Markdown / PNG reports of ``benchmarks/run.py``.

Per configuration, over the *measured* epochs (those after the warm-up):

* epoch time of an epoch = the slowest rank's (ranks are synchronous; the median of these is
  ``epoch_time``, their mean ``epoch_time_mean``, their range ``epoch_time_min/max``),
* phases of an epoch = the mean over ranks; the reported phase is the median over epochs,
* traffic of an epoch = the sum over ranks (what ``comm/bytes_sent`` logs) and the busiest
  rank's; reported: median,
* memory = per rank (peak resident set, baseline, peak above baseline), reported per rank and
  as max and mean over ranks.

Every mode is compared with ITS OWN bound (``adaqp`` with ``adaqp-bound``, see
``bench_modes``); a mode measurably faster than its bound is flagged (:func:`bound_checks`).
Reports written before the per-mode bounds existed (mode ``compute-only``) render too:
``compute-only`` is read as ``exact-bound``, and a mode without its own bound is shown against
``exact-bound``, marked.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench_modes import bound_of, canonical, is_bound, sort_key, unbound

PHASES = ("compute", "wait", "quant", "assign", "allreduce", "optimizer", "other")
PHASE_LABELS = {
    "compute": "compute (fwd+bwd)",
    "wait": "halo wait",
    "quant": "quantize",
    "assign": "bit assignment",
    "allreduce": "grad all-reduce",
    "optimizer": "optimizer",
    "other": "other",
}
CPU = ("cpu_user", "cpu_sys", "cpu_main_thread", "cpu_other_threads", "minor_faults")
DEFAULT_BOUND_TOLERANCE = 0.05
SPREAD_MIN_EPOCHS = 3  # "outside the measured spread" needs at least this many epochs on both sides


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


#: Trailing epochs every worker runs but nobody measures: Sylvie's last epoch sends nothing
#: (no later epoch would consume it), which would flatter a short measurement.
COOLDOWN_EPOCHS = 1


def summarize(results: dict[str, Any] | list[dict[str, Any]], warmup: int, cooldown: int = 0) -> dict[str, Any]:
    """Per-configuration figures from one worker result, or from repeats of the same
    configuration (their measured epochs pooled; see the module docstring); the first
    ``warmup`` and the last ``cooldown`` epochs are not measured."""
    if isinstance(results, dict):
        results = [results]
    per_epoch = []
    for repeat, result in enumerate(results):
        per_epoch += _epochs(result["ranks"], warmup, repeat, cooldown)
    ranks = [r for result in results for r in result["ranks"]]
    return _summary(per_epoch, ranks, len(results))


def _epochs(ranks: list[dict[str, Any]], warmup: int, repeat: int, cooldown: int = 0) -> list[dict[str, Any]]:
    n_epochs = min(len(r["epochs"]) for r in ranks)
    start = min(warmup, max(n_epochs - 1, 0))
    end = n_epochs - cooldown if n_epochs - cooldown > start else n_epochs
    measured = list(range(start, end))
    per_epoch = []
    for e in measured:
        recs = [r["epochs"][e] for r in ranks]
        row: dict[str, Any] = {
            "repeat": repeat, "epoch": recs[0]["epoch"], "epoch_time": max(x["epoch_time"] for x in recs)
        }
        for p in (*PHASES, *CPU, "forward", "backward", "step_time"):
            vals = [x[p] for x in recs if p in x]
            if vals:
                row[p] = statistics.fmean(vals)
        for k in ("bytes_sent", "bytes_recv", "exchanges", "bits_sent", "values_sent"):
            vals = [x[k] for x in recs if k in x]
            if vals:
                row[k] = sum(vals)
        for k in ("wait", "quant", "allreduce", "bytes_sent"):
            vals = [x[k] for x in recs if k in x]
            if vals:
                row[k + "_max"] = max(vals)
        row["assigned"] = any(x.get("assigned") for x in recs)
        if any("staleness_max" in x for x in recs):
            row["staleness_max"] = max(x.get("staleness_max", 0) for x in recs)
            row["staleness_mean"] = statistics.fmean(x.get("staleness_mean", 0.0) for x in recs)
            row["sync"] = all(x.get("sync", True) for x in recs)
        per_epoch.append(row)
    return per_epoch


def _stat(values: list[float], fn) -> float | None:
    return fn(values) if values else None


def _summary(per_epoch: list[dict[str, Any]], ranks: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    times = [r["epoch_time"] for r in per_epoch]
    bits_sent = sum(r.get("bits_sent", 0) for r in per_epoch)
    values_sent = sum(r.get("values_sent", 0) for r in per_epoch)
    mem = [r["memory"] for r in ranks]

    def mem_stat(key: str, fn) -> float | None:
        return _stat([m[key] for m in mem if m.get(key) is not None], fn)

    parts = [r["partition"] for r in ranks if r.get("partition")]

    def part_stat(key: str, fn) -> float | None:
        return _stat([p[key] for p in parts if p.get(key) is not None], fn)

    summary: dict[str, Any] = {
        "repeats": repeats,
        "epochs_measured": len(per_epoch),
        "epoch_time": _median(times),
        "epoch_time_mean": _mean(times),
        "epoch_time_min": min(times) if times else None,
        "epoch_time_max": max(times) if times else None,
        "phases": {p: _median([r[p] for r in per_epoch if p in r]) for p in (*PHASES, "forward", "backward")},
        "cpu": {p: _median([r[p] for r in per_epoch if p in r]) for p in CPU},
        "wait_max_rank": _median([r["wait_max"] for r in per_epoch if "wait_max" in r]),
        "allreduce_max_rank": _median([r["allreduce_max"] for r in per_epoch if "allreduce_max" in r]),
        "bytes_sent": _median([r["bytes_sent"] for r in per_epoch if "bytes_sent" in r]),
        "bytes_sent_max_rank": _median([r["bytes_sent_max"] for r in per_epoch if "bytes_sent_max" in r]),
        "bytes_recv": _median([r["bytes_recv"] for r in per_epoch if "bytes_recv" in r]),
        "exchanges": _median([r["exchanges"] for r in per_epoch if "exchanges" in r]),
        "bits": (bits_sent / values_sent) if values_sent else None,
        "assign_epochs": sum(1 for r in per_epoch if r["assigned"]),
        "memory": {
            "peak_rss_max": mem_stat("peak_rss", max),
            "peak_rss_mean": mem_stat("peak_rss", statistics.fmean),
            "rss_baseline_mean": mem_stat("rss_baseline", statistics.fmean),
            "rss_after_load_mean": mem_stat("rss_after_load", statistics.fmean),
            "peak_above_baseline_max": mem_stat("peak_above_baseline", max),
            "peak_above_baseline_mean": mem_stat("peak_above_baseline", statistics.fmean),
            "cuda_max_allocated_max": mem_stat("cuda_max_allocated", max),
        },
        "partition": {
            "owned_mean": part_stat("owned", statistics.fmean),
            "owned_max": part_stat("owned", max),
            "halo_mean": part_stat("halo", statistics.fmean),
            "halo_max": part_stat("halo", max),
            "edges_mean": part_stat("edges", statistics.fmean),
            "edges_max": part_stat("edges", max),
        },
        "strategy": next((r["strategy"] for r in ranks if r.get("strategy")), None),
        "per_epoch": per_epoch,
    }
    if any("staleness_max" in r for r in per_epoch):
        summary["staleness_max"] = max(r.get("staleness_max", 0) for r in per_epoch)
        summary["staleness_mean"] = statistics.fmean(r.get("staleness_mean", 0.0) for r in per_epoch)
        summary["sync_epochs"] = sum(1 for r in per_epoch if r.get("sync"))
    return summary


# -- selection -----------------------------------------------------------------------------
def _f(value: float | None, fmt: str = "{:.3f}", none: str = "–") -> str:
    return none if value is None else fmt.format(value)


def _mb(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:.2f}"


def _mode(run: dict[str, Any]) -> str:
    return canonical(run["mode"])


def _group(run: dict[str, Any]) -> str:
    return run.get("group") or ""


def _groups(report: dict[str, Any], section: str = "main") -> list[str]:
    """Comparison groups (link scope / balance settings) in the order they ran."""
    return list(dict.fromkeys(_group(r) for r in report["runs"] if r["section"] == section))


def _runs(report: dict[str, Any], section: str) -> list[dict[str, Any]]:
    runs = [r for r in report["runs"] if r["section"] == section and r.get("summary")]
    order = {g: i for i, g in enumerate(_groups(report, section))}
    return sorted(runs, key=lambda r: (order.get(_group(r), 0), r["graph_key"], r["ranks"], sort_key(_mode(r))))


def _find(report: dict[str, Any], section: str, graph_key: str, ranks: int, mode: str,
          group: str = "") -> dict[str, Any] | None:
    mode = canonical(mode)
    for r in report["runs"]:
        if (
            r["section"] == section
            and r["graph_key"] == graph_key
            and r["ranks"] == ranks
            and _mode(r) == mode
            and _group(r) == group
            and r.get("summary")
        ):
            return r
    return None


def _label(run: dict[str, Any], with_group: bool) -> str:
    return (f"{_group(run)} | " if with_group else "") + f"{run['graph_label']} | {run['ranks']} | {_mode(run)}"


def own_bound(report: dict[str, Any], run: dict[str, Any], section: str = "main") -> tuple[dict[str, Any] | None, bool]:
    """``(bound run, is its own)``: the run of ``<mode>-bound`` in the same group, graph and
    rank count; without one (old reports), ``exact-bound``, marked as not its own."""
    mode = _mode(run)
    bound = _find(report, section, run["graph_key"], run["ranks"], bound_of(mode), _group(run))
    if bound is not None or is_bound(mode):
        return bound, True
    return _find(report, section, run["graph_key"], run["ranks"], "exact-bound", _group(run)), False


def bound_check(mode_summary: dict[str, Any], bound_summary: dict[str, Any],
                tolerance: float = DEFAULT_BOUND_TOLERANCE) -> dict[str, Any]:
    """Is a mode faster than its own bound beyond noise?

    ``ratio`` = mode's median epoch / bound's.  Flagged when the mode is faster by more than
    ``tolerance`` (ratio < 1 - tolerance), or when its whole measured range lies below the
    bound's (max < min, both with >= 3 measured epochs).  A bound runs the same computation
    minus the transfers, so a flagged mode means noise larger than the gap, or a bound that
    does not run the mode's path."""
    t, b = mode_summary["epoch_time"], bound_summary["epoch_time"]
    ratio = t / b if t and b else None
    below_spread = (
        (mode_summary.get("epochs_measured") or 0) >= SPREAD_MIN_EPOCHS
        and (bound_summary.get("epochs_measured") or 0) >= SPREAD_MIN_EPOCHS
        and mode_summary.get("epoch_time_max") is not None
        and bound_summary.get("epoch_time_min") is not None
        and mode_summary["epoch_time_max"] < bound_summary["epoch_time_min"]
    )
    beyond = ratio is not None and ratio < 1.0 - tolerance
    return {"ratio": ratio, "flag": bool(beyond or below_spread), "beyond_tolerance": beyond,
            "below_spread": bool(below_spread)}


def bound_checks(report: dict[str, Any], section: str = "main") -> list[dict[str, Any]]:
    """:func:`bound_check` of every mode of a section against its own bound, with a message."""
    tol = (report.get("config") or {}).get("bound_tolerance") or DEFAULT_BOUND_TOLERANCE
    out = []
    for run in _runs(report, section):
        if is_bound(_mode(run)):
            continue
        bound, own = own_bound(report, run, section)
        if bound is None:
            continue
        c = bound_check(run["summary"], bound["summary"], tol)
        c.update(run=run, bound=bound, own=own)
        s, bs = run["summary"], bound["summary"]
        where = f"{run['graph_label']} @{run['ranks']}" + (f" [{_group(run)}]" if _group(run) else "")
        why = " and ".join(
            w for w, on in (
                (f"more than {tol:.0%} faster", c["beyond_tolerance"]),
                ("its slowest measured epoch beat the bound's fastest", c["below_spread"]),
            ) if on
        )
        c["message"] = (
            f"{_mode(run)} ran FASTER THAN " + (f"ITS BOUND {_mode(bound)}" if own else
                                                 f"{_mode(bound)} (no {bound_of(_mode(run))} in this run)")
            + f" ({where}): median epoch "
            f"{s['epoch_time']:.3f}s vs {bs['epoch_time']:.3f}s = {c['ratio']:.2f}x ({why}; ranges "
            f"{_f(s.get('epoch_time_min'))}-{_f(s.get('epoch_time_max'))}s vs "
            f"{_f(bs.get('epoch_time_min'))}-{_f(bs.get('epoch_time_max'))}s): noise beyond the gap, or the bound "
            "does not run this mode's path; do not read this row's ratio as a result"
        ) if c["flag"] else ""
        out.append(c)
    return out


# -- tables --------------------------------------------------------------------------------
def main_rows(report: dict[str, Any], section: str = "main") -> list[dict[str, Any]]:
    """Rows of the side-by-side table, with speedup over exact and the ratio to the mode's
    own bound."""
    checks = {id(c["run"]): c for c in bound_checks(report, section)}
    rows = []
    for run in _runs(report, section):
        s = run["summary"]
        exact = _find(report, section, run["graph_key"], run["ranks"], "exact", _group(run))
        bound, own = own_bound(report, run, section)
        t, tm = s["epoch_time"], s["epoch_time_mean"]
        check = checks.get(id(run))
        rows.append({
            "run": run,
            "speedup": exact["summary"]["epoch_time"] / t if exact and t else None,
            "speedup_mean": exact["summary"]["epoch_time_mean"] / tm if exact and tm else None,
            "bound": None if is_bound(_mode(run)) else bound,
            "own_bound": own,
            "vs_bound": t / bound["summary"]["epoch_time"] if bound and t and not is_bound(_mode(run)) else None,
            "vs_bound_mean": (tm / bound["summary"]["epoch_time_mean"]
                              if bound and tm and not is_bound(_mode(run)) else None),
            "flag": bool(check and check["flag"]),
        })
    return rows


def _spread(s: dict[str, Any]) -> str:
    if s.get("epoch_time_min") is None:
        return "–"
    return f"{s['epoch_time_min']:.3f}–{s['epoch_time_max']:.3f}"


def main_table(report: dict[str, Any], section: str = "main") -> str:
    with_group = len(_groups(report, section)) > 1
    lines = [
        ("| setting " if with_group else "")
        + "| graph | ranks | mode | epoch s (median) | epoch s (mean) | epoch s (min–max) | speedup vs exact "
        "| × own bound | MB sent/epoch | bits/value | halo wait s (mean / max rank) | peak RSS/rank MiB (max) "
        "| above baseline MiB (max) | test acc |",
        ("|---" if with_group else "") + "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in main_rows(report, section):
        run, s = row["run"], row["run"]["summary"]
        m = s["memory"]
        if is_bound(_mode(run)):
            vs = "bound"
        elif row["vs_bound"] is None:
            vs = "–"
        else:
            vs = f"{row['vs_bound']:.2f}x" + ("" if row["own_bound"] else " (vs exact-bound)†")
            if row["flag"]:
                vs = f"**{vs} FASTER THAN ITS BOUND**"
        sent = f"({_mb(s['bytes_sent'])})" if is_bound(_mode(run)) and s.get("bytes_sent") else _mb(s["bytes_sent"])
        wait = f"{_f(s['phases'].get('wait'))} / {_f(s.get('wait_max_rank'))}"
        lines.append(
            f"| {_label(run, with_group)} | {_f(s['epoch_time'])} | {_f(s['epoch_time_mean'])} | {_spread(s)} | "
            f"{_f(row['speedup'], '{:.2f}x')} | {vs} | {sent} | {_f(s['bits'], '{:.2f}')} | {wait} | "
            f"{_f(m['peak_rss_max'], '{:.0f}')} | {_f(m['peak_above_baseline_max'], '{:.0f}')} | "
            f"{_f(run.get('test_acc'), '{:.4f}')} |"
        )
    return "\n".join(lines)


MAIN_TABLE_NOTES = (
    "`× own bound` = this mode's median epoch / the median epoch of its own bound (`adaqp` / `adaqp-bound`: "
    "the same mode, same compute path, halo transfers skipped); 1.00x is the bound, what the mode would take "
    "with free communication. `speedup vs exact` = exact's median epoch / this row's. Bound rows show in "
    "parentheses the halo bytes their counters count but never send."
)


def speedup_table(report: dict[str, Any], section: str = "main") -> str:
    """Speedup of every mode (and bound) over exact, one row per group, graph and rank count."""
    runs = _runs(report, section)
    modes = sorted({_mode(r) for r in runs}, key=sort_key)
    with_group = len(_groups(report, section)) > 1
    lines = [("| setting " if with_group else "") + "| graph | ranks | exact epoch s | "
             + " | ".join(modes) + " |",
             ("|---" if with_group else "") + "|---|---:|---:|" + "---:|" * len(modes)]
    seen = []
    for run in runs:
        key = (_group(run), run["graph_key"], run["ranks"])
        if key in seen:
            continue
        seen.append(key)
        exact = _find(report, section, run["graph_key"], run["ranks"], "exact", _group(run))
        cells = []
        for mode in modes:
            r = _find(report, section, run["graph_key"], run["ranks"], mode, _group(run))
            cells.append(_f(exact["summary"]["epoch_time"] / r["summary"]["epoch_time"]
                            if exact and r and r["summary"]["epoch_time"] else None, "{:.2f}x"))
        lines.append(("| " + _group(run) + " " if with_group else "")
                     + f"| {run['graph_label']} | {run['ranks']} | "
                     f"{_f(exact['summary']['epoch_time'] if exact else None)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: two-sided 95 % quantiles of Student's t by degrees of freedom 1-30 (beyond: the normal's 1.96)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def round_medians(summary: dict[str, Any], key: str = "epoch_time") -> list[float]:
    """Per round (``--repeat``), the median of ``key`` over that round's measured epochs, in
    round order."""
    by_round: dict[int, list[float]] = {}
    for row in summary.get("per_epoch") or []:
        if row.get(key) is not None:
            by_round.setdefault(row["repeat"], []).append(row[key])
    return [statistics.median(by_round[k]) for k in sorted(by_round)]


def paired_ratio(mode_summary: dict[str, Any], base_summary: dict[str, Any],
                 key: str = "epoch_time") -> dict[str, Any] | None:
    """A mode against a baseline round by round: each round's median of ``key`` over the same
    round's median of the baseline, then the mean of those ratios and its 95 % confidence
    interval (Student's t over rounds).

    Pairing by round removes what moves both runs of a round alike (the host's speed drifting
    between rounds; the runner reverses the order of the modes every other round), so the
    interval is about the ratio, not the host. ``None`` with fewer than two rounds on
    either side, or unequal counts (a failed round: the pairs would not be the same rounds)."""
    mode, base = round_medians(mode_summary, key), round_medians(base_summary, key)
    if len(mode) != len(base) or len(mode) < 2 or not all(base):
        return None
    ratios = [m / b for m, b in zip(mode, base)]
    n = len(ratios)
    mean = statistics.fmean(ratios)
    half = (T95[n - 2] if n - 1 <= len(T95) else 1.96) * statistics.stdev(ratios) / math.sqrt(n)
    return {"ratios": ratios, "rounds": n, "mean": mean, "low": mean - half, "high": mean + half}


def paired_rows(report: dict[str, Any], section: str = "main") -> list[dict[str, Any]]:
    """:func:`paired_ratio` of every mode against exact and every bound against exact-bound
    (same group, graph and rank count), on wall time and on the main thread's CPU time."""
    rows = []
    for run in _runs(report, section):
        mode = _mode(run)
        base_mode = "exact-bound" if is_bound(mode) else "exact"
        if mode == base_mode or run.get("error"):
            continue
        base = _find(report, section, run["graph_key"], run["ranks"], base_mode, _group(run))
        if base is None or base.get("error"):
            continue
        wall = paired_ratio(run["summary"], base["summary"])
        if wall is None:
            continue
        rows.append({"run": run, "base": base_mode, "wall": wall,
                     "cpu": paired_ratio(run["summary"], base["summary"], "cpu_main_thread")})
    return rows


def paired_table(report: dict[str, Any], section: str = "main") -> str:
    with_group = len(_groups(report, section)) > 1
    lines = [("| setting " if with_group else "") + "| graph | ranks | mode | against | rounds | wall: mean [95 % CI] "
             "| main-thread CPU: mean [95 % CI] | wall, round by round |",
             ("|---" if with_group else "") + "|---|---:|---|---|---:|---|---|---|"]

    def ci(r: dict[str, Any] | None) -> str:
        return "–" if r is None else f"{r['mean']:.3f}x [{r['low']:.3f}, {r['high']:.3f}]"

    for row in paired_rows(report, section):
        lines.append(f"| {_label(row['run'], with_group)} | {row['base']} | {row['wall']['rounds']} | "
                     f"{ci(row['wall'])} | {ci(row['cpu'])} | "
                     + ", ".join(f"{x:.2f}" for x in row["wall"]["ratios"]) + " |")
    return "\n".join(lines)


PAIRED_NOTES = (
    "Each round ran every configuration once (the order reversed every other round); a round's "
    "ratio is the mode's median epoch over the same round's median epoch of `exact` (for a bound: "
    "`exact-bound`). The interval is Student's t over the rounds' ratios: a ratio goal is shown met "
    "when the interval's top is below it, missed when its bottom is above it, and undecided otherwise. "
    "Main-thread CPU leaves out the time a rank waits for a core (4 ranks share 2 here)."
)


def phase_table(report: dict[str, Any], section: str = "main") -> str:
    with_group = len(_groups(report, section)) > 1
    head = " | ".join(PHASE_LABELS[p] for p in PHASES)
    lines = [
        ("| setting " if with_group else "")
        + f"| graph | ranks | mode | epoch s | {head} | halo wait, most-waiting rank | wire s (bytes / link rate) |",
        ("|---" if with_group else "") + "|---|---:|---|---:|" + "---:|" * (len(PHASES) + 2),
    ]
    for run in _runs(report, section):
        s = run["summary"]
        cells = " | ".join(_f(s["phases"].get(p)) for p in PHASES)
        lines.append(
            f"| {_label(run, with_group)} | {_f(s['epoch_time'])} | {cells} | "
            f"{_f(s.get('wait_max_rank'))} | {_f(None if is_bound(_mode(run)) else wire_seconds(run))} |"
        )
    return "\n".join(lines)


def wire_seconds(run: dict[str, Any]) -> float | None:
    """Seconds the epoch's halo bytes need at the emulated rate (payload only, no headers)."""
    rate = run.get("link_rate_bps")
    sent = run["summary"].get("bytes_sent")
    if not rate or sent is None:
        return None
    return sent * 8 / rate


def cpu_table(report: dict[str, Any], section: str = "main") -> str:
    with_group = len(_groups(report, section)) > 1
    lines = [
        ("| setting " if with_group else "")
        + "| graph | ranks | mode | epoch s (wall) | CPU user s | CPU sys s | main thread CPU s | other threads CPU s "
        "| minor page faults |",
        ("|---" if with_group else "") + "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in _runs(report, section):
        s = run["summary"]
        c = s.get("cpu") or {}
        lines.append(
            f"| {_label(run, with_group)} | {_f(s['epoch_time'])} | "
            f"{_f(c.get('cpu_user'))} | {_f(c.get('cpu_sys'))} | {_f(c.get('cpu_main_thread'))} | "
            f"{_f(c.get('cpu_other_threads'))} | {_f(c.get('minor_faults'), '{:.0f}')} |"
        )
    return "\n".join(lines)


def _per_rank(run: dict[str, Any], fn) -> list[Any]:
    return [fn(r) for r in sorted(run.get("ranks_detail") or [], key=lambda r: r["rank"])]


def _max_mean(values: list[float | None], fmt: str = "{:.0f}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    mean = statistics.fmean(vals)
    return f"{fmt.format(max(vals))} / {fmt.format(mean)} ({max(vals) / mean:.2f})" if mean else "–"


def balance_table(report: dict[str, Any], section: str = "main") -> str:
    """Per run: nodes, edges and halo rows per rank (max / mean (max/mean)), halo wait (mean
    over ranks / most-waiting rank) and every rank's peak RSS above its baseline."""
    with_group = len(_groups(report, section)) > 1
    lines = [
        ("| setting " if with_group else "")
        + "| graph | ranks | mode | nodes/rank max / mean (max/mean) | edges/rank max / mean (max/mean) "
        "| halo rows/rank max / mean (max/mean) | halo wait s/epoch mean / max rank | grad all-reduce s mean / max rank "
        "| peak RSS above baseline MiB per rank |",
        ("|---" if with_group else "") + "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for run in _runs(report, section):
        s = run["summary"]
        owned = _per_rank(run, lambda r: (r.get("partition") or {}).get("owned"))
        edges = _per_rank(run, lambda r: (r.get("partition") or {}).get("edges"))
        halo = _per_rank(run, lambda r: (r.get("partition") or {}).get("halo"))
        above = _per_rank(run, lambda r: (r.get("memory") or {}).get("peak_above_baseline"))
        lines.append(
            f"| {_label(run, with_group)} | {_max_mean(owned)} | {_max_mean(edges)} | {_max_mean(halo)} | "
            f"{_f(s['phases'].get('wait'))} / {_f(s.get('wait_max_rank'))} | "
            f"{_f(s['phases'].get('allreduce'))} / {_f(s.get('allreduce_max_rank'))} | "
            + " / ".join(_f(a, "{:.0f}") for a in above) + " |"
        )
    return "\n".join(lines)


def partition_lines(report: dict[str, Any]) -> list[str]:
    out = []
    for g in report["graphs"].values():
        for key, p in sorted(g.get("partitions", {}).items()):
            if "nodes_per_part" not in p:
                continue
            bal = p.get("balance") or p.get("requested_balance") or "?"
            out.append(
                f"- {g['label']}, {key.split('-')[0]} parts, balance {bal}: nodes/part {p['nodes_per_part']} "
                f"(max/mean {_f(p.get('nodes_imbalance'), '{:.3f}')}), in-edges/part {p.get('edges_per_part')} "
                f"(max/mean {_f(p.get('edges_imbalance'), '{:.3f}')}), halo rows/part {p.get('halo_per_part')}"
            )
    return out


def comm_rows(report: dict[str, Any], section: str = "main") -> list[dict[str, Any]]:
    """Exact's communication share per group, graph and rank count.

    * ``vs_bound``: ``(exact - exact-bound) / exact``, both on the same link (the bound still
      all-reduces the gradients across it): the halo transfers' share of exact's epoch,
    * ``vs_unthrottled``: ``(exact - T_c) / exact`` with ``T_c`` the unthrottled exact-bound of
      the calibration: all communication (halo + gradient all-reduce), what the calibration targets,
    * ``wait_share``: (halo wait + grad all-reduce) / epoch, mean over ranks; ``wait_share_max``
      the same for the most-waiting rank."""
    cal = {(c["graph_key"], c["ranks"], c["scope"]): c for c in report.get("calibration") or []}
    rows = []
    for run in _runs(report, section):
        if _mode(run) != "exact":
            continue
        s = run["summary"]
        e = s["epoch_time"]
        bound = _find(report, section, run["graph_key"], run["ranks"], "exact-bound", _group(run))
        c = cal.get((run["graph_key"], run["ranks"], run.get("link_scope")))
        if c is not None and run.get("balance") != c.get("balance"):
            c = None
        wait, ar = s["phases"].get("wait"), s["phases"].get("allreduce")
        wait_max, ar_max = s.get("wait_max_rank"), s.get("allreduce_max_rank")
        rows.append({
            "run": run, "epoch": e, "bound": bound["summary"]["epoch_time"] if bound else None,
            "vs_bound": (e - bound["summary"]["epoch_time"]) / e if bound and e else None,
            "t_c": c["compute_s"] if c else None,
            "vs_unthrottled": (e - c["compute_s"]) / e if c and e else None,
            "wait_share": (wait + (ar or 0.0)) / e if wait is not None and e else None,
            "wait_share_max": (wait_max + (ar_max or 0.0)) / e if wait_max is not None and e else None,
            "wire": wire_seconds(run), "calibration": c,
        })
    return rows


def comm_table(report: dict[str, Any], section: str = "main") -> str:
    with_group = len(_groups(report, section)) > 1
    lines = [
        ("| setting " if with_group else "")
        + "| graph | ranks | link (per link; bucket) | exact epoch s | exact-bound epoch s (same link) "
        "| (exact − bound) / exact | exact-bound unthrottled T_c s | (exact − T_c) / exact "
        "| wait share (halo wait + all-reduce) mean / max rank | wire s |",
        ("|---" if with_group else "") + "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in comm_rows(report, section):
        run = row["run"]
        base, bucket = run.get("link_base_bps"), run.get("link_rate_bps")
        link = (f"{run.get('link', report['config'].get('link'))} "
                + (f"{base / 1e6:.0f} Mbit/s" if base else "") + (f"; {bucket / 1e6:.0f}" if bucket and bucket != base else ""))
        lines.append(
            ("| " + _group(run) + " " if with_group else "")
            + f"| {run['graph_label']} | {run['ranks']} | {link} | {_f(row['epoch'])} | {_f(row['bound'])} | "
            f"{_f(row['vs_bound'], '{:.0%}')} | {_f(row['t_c'])} | {_f(row['vs_unthrottled'], '{:.0%}')} | "
            f"{_f(row['wait_share'], '{:.0%}')} / {_f(row['wait_share_max'], '{:.0%}')} | {_f(row['wire'])} |"
        )
    return "\n".join(lines)


def calibration_table(report: dict[str, Any]) -> str:
    cal = report.get("calibration") or []
    measured = {(r["run"]["graph_key"], r["run"]["ranks"], r["run"].get("link_scope")): r
                for r in comm_rows(report) if r["run"].get("balance") == (cal[0].get("balance") if cal else None)}
    lines = [
        "| ranks | scope | T_c s (exact-bound, unthrottled; min–max) | halo MB/epoch all ranks / busiest rank "
        "| grad all-reduce MB/rank | MB/epoch on the link | rate from T_c, Mbit/s | probe: comm share "
        "| rate used, Mbit/s per link (bucket) | exact: (exact − T_c) / exact | exact: wait share mean / max rank |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cal:
        m = measured.get((c["graph_key"], c["ranks"], c["scope"]))
        factor = c["ranks"] if c["scope"] == "per-rank" else 1
        probe = c.get("probe")
        f = m["vs_unthrottled"] if m else None
        band = c.get("band", 0.05)
        f_cell = _f(f, "{:.0%}")
        if f is not None and abs(f - c["target"]) > band:
            f_cell = f"**{f_cell} (outside {c['target'] - band:.0%}–{c['target'] + band:.0%})**"
        lines.append(
            f"| {c['ranks']} | {c['scope']} | {_f(c['compute_s'])} ({_f(c.get('compute_s_min'))}–"
            f"{_f(c.get('compute_s_max'))}) | {_mb(c['halo_bytes_total'])} / {_mb(c.get('halo_bytes_max_rank'))} | "
            f"{_mb(c['allreduce_bytes_per_rank'])} | {_mb(c['link_bytes'])} | "
            f"{_f(c.get('initial_rate_bps', 0) / 1e6, '{:.1f}')} | "
            + (f"{probe['fraction']:.0%} at {probe['rate_bps'] / 1e6:.1f}" if probe else "–")
            + (" → rescaled" if c.get("rescaled") else "")
            + f" | {c['rate_bps'] / 1e6:.1f} ({c['rate_bps'] * factor / 1e6:.1f}) | {f_cell} | "
            f"{_f(m['wait_share'] if m else None, '{:.0%}')} / {_f(m['wait_share_max'] if m else None, '{:.0%}')} |"
        )
    return "\n".join(lines)


CALIBRATION_NOTES = (
    "How the rate is chosen: `exact-bound` runs first without throttling; its median epoch is T_c "
    "(exact's computation without halo transfers) and its counters give the halo bytes exact sends per epoch. "
    "The link must carry, per epoch, those halo bytes plus the ring all-reduce of the weight gradients "
    "(2 (ranks−1)/ranks × parameter bytes per rank): shared scope, all ranks' bytes through one bucket; per-rank "
    "scope, the busiest rank's bytes through its own link (bucket = rate × ranks). rate = bytes × (1−t) / (t × T_c), "
    "t = target share (0.75: bytes / (3 T_c)). A short exact probe at that rate measures (epoch − T_c) / epoch; "
    "outside the band the rate is rescaled once by rate × f (1−t) / (t (1−f)). The last columns are measured on "
    "the main comparison's exact run."
)


PEER_LABELS = {"sparse": "sparse CSR (adj_t)", "sparse-cached": "sparse CSR, GCN cached=True",
               "edge_index": "edge_index"}


def peer_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in report.get("peer") or [] if p.get("summary")]


def peer_table(report: dict[str, Any]) -> str:
    lines = [
        "| input | torch threads | epoch s (median) | epoch s (mean) | epoch s (min–max) | CPU s/epoch "
        "| peak RSS MiB | above baseline MiB | adjacency build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in peer_rows(report):
        s = p["summary"]
        m = s["memory"]
        lines.append(
            f"| {PEER_LABELS.get(p['variant'], p['variant'])} | {p['threads']} | "
            f"{_f(s['epoch_time'])} | {_f(s['epoch_time_mean'])} | {_spread(s)} | {_f(s.get('cpu'))} | "
            f"{_f(m.get('peak_rss'), '{:.0f}')} | {_f(m.get('peak_above_baseline'), '{:.0f}')} | "
            f"{_f(p.get('build_s'))} |"
        )
    return "\n".join(lines)


def _peer(report: dict[str, Any], variant: str, threads: int | None = None) -> dict[str, Any] | None:
    rows = [p for p in peer_rows(report) if p["variant"] == variant and (threads is None or p["threads"] == threads)]
    return max(rows, key=lambda p: p["threads"]) if rows else None


def peer_ratio_lines(report: dict[str, Any]) -> list[str]:
    """``R-rank exact-bound epoch / peer sparse epoch`` (R = 4 if run, else the most ranks)."""
    out = []
    runs = [r for r in _runs(report, "main") if _mode(r) == "exact-bound"]
    if not runs or not peer_rows(report):
        return out
    first_group = _groups(report)[0]
    runs = [r for r in runs if _group(r) == first_group] or runs
    ranks = 4 if any(r["ranks"] == 4 for r in runs) else max(r["ranks"] for r in runs)
    bound = next(r for r in runs if r["ranks"] == ranks)
    exact = _find(report, "main", bound["graph_key"], ranks, "exact", _group(bound))
    for p in sorted((p for p in peer_rows(report) if p["variant"] == "sparse"), key=lambda p: -p["threads"]):
        pe = p["summary"]["epoch_time"]
        out.append(
            f"- **{ranks}-rank exact-bound epoch / peer sparse epoch ({p['threads']} thread"
            f"{'s' if p['threads'] > 1 else ''}) = {bound['summary']['epoch_time'] / pe:.2f}** "
            f"({bound['summary']['epoch_time']:.3f} s / {pe:.3f} s)"
            + (f"; {ranks}-rank exact / peer sparse = {exact['summary']['epoch_time'] / pe:.2f}" if exact else "")
        )
        cached = _peer(report, "sparse-cached", p["threads"])
        if cached:
            ce = cached["summary"]["epoch_time"]
            out.append(f"  - against the peer with GCN's normalisation cached (sparse-cached, {p['threads']} thread"
                       f"{'s' if p['threads'] > 1 else ''}): {bound['summary']['epoch_time'] / ce:.2f} "
                       f"({ce:.3f} s)")
    return out


def side_by_side_table(report: dict[str, Any]) -> str:
    """The distributed modes (first group) next to the single-process peer, epoch seconds."""
    ref = _peer(report, "sparse")
    runs = _runs(report, "main")
    first_group = _groups(report)[0] if runs else ""
    lines = ["| configuration | processes × threads | epoch s (median) | × peer sparse epoch |",
             "|---|---|---:|---:|"]
    ref_t = ref["summary"]["epoch_time"] if ref else None
    order = {v: i for i, v in enumerate(PEER_LABELS)}
    for p in sorted(peer_rows(report), key=lambda p: (order.get(p["variant"], 9), -p["threads"])):
        t = p["summary"]["epoch_time"]
        lines.append(f"| peer, PyG {PEER_LABELS.get(p['variant'], p['variant'])}, whole graph | "
                     f"1 × {p['threads']} | {_f(t)} | {_f(t / ref_t if ref_t else None, '{:.2f}x')} |")
    for run in runs:
        if _group(run) != first_group:
            continue
        t = run["summary"]["epoch_time"]
        lines.append(f"| {_mode(run)} ({run['graph_label']}) | {run['ranks']} × 1 | {_f(t)} | "
                     f"{_f(t / ref_t if ref_t else None, '{:.2f}x')} |")
    return "\n".join(lines)


def scaling_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    seen = set()
    first_group = (_groups(report) or [""])[0]
    candidates = [r for r in report["runs"] if _mode(r) == "exact" and r.get("summary")
                  and (r["section"] == "scaling" or (r["section"] == "main" and _group(r) == first_group))]
    for run in candidates:
        key = (run["graph_key"], run["ranks"])
        if key in seen:
            continue
        seen.add(key)
        rows.append(run)
    return sorted(rows, key=lambda r: (r["graph_nodes"], r["ranks"]))


def scaling_table(report: dict[str, Any]) -> str:
    lines = [
        "| graph | nodes | ranks | epoch s (median) | exact-bound epoch s | owned nodes/rank | halo nodes/rank "
        "| baseline RSS MiB | peak RSS/rank MiB (max) | above baseline MiB (max) | above baseline MiB (mean) "
        "| peak RSS MiB per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    first_group = (_groups(report) or [""])[0]
    for run in scaling_rows(report):
        s = run["summary"]
        m = s["memory"]
        p = s["partition"]
        bound = _find(report, "main", run["graph_key"], run["ranks"], "exact-bound", first_group)
        peaks = _per_rank(run, lambda r: (r.get("memory") or {}).get("peak_rss"))
        lines.append(
            f"| {run['graph_label']} | {run['graph_nodes']} | {run['ranks']} | {_f(s['epoch_time'])} | "
            f"{_f(bound['summary']['epoch_time'] if bound else None)} | {_f(p['owned_mean'], '{:.0f}')} | "
            f"{_f(p['halo_mean'], '{:.0f}')} | {_f(m['rss_baseline_mean'], '{:.0f}')} | "
            f"{_f(m['peak_rss_max'], '{:.0f}')} | {_f(m['peak_above_baseline_max'], '{:.0f}')} | "
            f"{_f(m['peak_above_baseline_mean'], '{:.0f}')} | " + " / ".join(_f(x, "{:.0f}") for x in peaks) + " |"
        )
    return "\n".join(lines)


#: The graph issue 31's epoch speed-up goals are set on (1 Gbit/s shared; the communication-bound
#: preset, which runs it). Issue 28's goals on the other graphs are on time to accuracy
#: (``run.py --convergence``), which an epoch benchmark does not measure.
GOAL_GRAPH = "tolokers"


def goal_lines(report: dict[str, Any]) -> list[str]:
    """The issue's goals, checked on the largest rank count of every group of the main section."""
    out = []
    rows = main_rows(report)
    if not rows:
        return out
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((_group(r["run"]), r["run"]["graph_key"]), {}).setdefault(r["run"]["ranks"], {})[
            _mode(r["run"])] = r
    for (group, graph_key), by_ranks in by_key.items():
        ranks = max(by_ranks)
        by_mode = by_ranks[ranks]
        label = next(iter(by_mode.values()))["run"]["graph_label"]
        head = f"{label}, {ranks} ranks, link {report['config']['link']}" + (f" [{group}]" if group else "")
        exact_bound = by_mode.get("exact-bound")
        # issue 31's goals for the communication-bound regime (calibrated link, shared scope) and
        # the 1 Gbit/s link (issue 10's were 2.5x / 3x and 1.5x / 2x); both are set on tolokers
        # only (the preset runs tolokers): another graph's epoch speed-up is shown, not judged
        commbound = report["config"]["link"] == "calibrated"
        need = {"adaqp": 3.0, "sylvie": 3.5} if commbound else {"adaqp": 2.5, "sylvie": 3.0}
        judged = graph_key == GOAL_GRAPH
        for mode in ("adaqp", "sylvie"):
            r = by_mode.get(mode)
            if r is None or r["speedup"] is None:
                continue
            ok = r["speedup"] >= need[mode]
            verdict = (
                f"goal >= {need[mode]:g}x: **{'met' if ok else 'NOT met'}**" if judged
                else f"no epoch-speed goal is set on this graph (issue 31's are on {GOAL_GRAPH})"
            )
            out.append(
                f"- {head}: {mode} speedup over exact = {r['speedup']:.2f}x (median; "
                f"{_f(r['speedup_mean'], '{:.2f}x')} on the mean) — {verdict}"
            )
        if "sylvie" in by_mode and by_mode["sylvie"]["vs_bound"] is not None:
            r = by_mode["sylvie"]
            own = "sylvie-bound" if r["own_bound"] else "exact-bound"
            extra = ""
            if r["own_bound"] and exact_bound:
                extra = (f"; vs exact-bound {r['run']['summary']['epoch_time'] / exact_bound['run']['summary']['epoch_time']:.2f}x")
            goal = (f" — goal <= 1.2x: **{'met' if r['vs_bound'] <= 1.2 else 'NOT met'}**"
                    if commbound and judged else "")
            summary = r["run"]["summary"]
            if summary.get("sync_epochs") is not None:
                # above `max_halo_share` the pipeline never runs: every epoch is synchronous
                extra += f"; {summary['sync_epochs']} of {summary['epochs_measured']} measured epochs synchronous"
            out.append(
                f"- {head}: sylvie / {own} = {r['vs_bound']:.2f}x (median epoch; "
                f"{_f(r['vs_bound_mean'], '{:.2f}x')} on the mean, which counts its synchronous epochs{extra})"
                + goal + (" (flagged: faster than its bound)" if r["flag"] else "")
            )
        if "adaqp" in by_mode and by_mode["adaqp"]["vs_bound"] is not None and by_mode["adaqp"]["own_bound"]:
            out.append(f"- {head}: adaqp / adaqp-bound = {by_mode['adaqp']['vs_bound']:.2f}x")
        if "exact" in by_mode and by_mode["exact"]["vs_bound"] is not None:
            r = by_mode["exact"]
            out.append(f"- {head}: exact / exact-bound = {r['vs_bound']:.2f}x (the gap compression attacks; "
                       f"an upper limit on any mode's speedup only if the modes' bounds are no faster than exact-bound)")
    return out


def markdown(report: dict[str, Any], png_name: str | None) -> str:
    cfg = report["config"]
    lines = [f"# Benchmark `{report['name']}`", ""]
    host = report.get("host", {})
    lines.append(
        f"{report.get('created', '?')} · {cfg.get('conv', '?')} x{cfg.get('layers', '?')} hidden {cfg.get('hidden', '?')}"
        f" · malloc {cfg.get('malloc', 'default')}"
        f" · link **{cfg.get('link', '?')}**"
        f" ({report.get('link', {}).get('description', '?')}) · "
        + (f"{cfg.get('warmup')} warm-up + {cfg.get('epochs')} measured epochs"
           + (f" x {cfg['repeat']} rounds" if (cfg.get("repeat") or 1) > 1 else "") + " · "
           if _runs(report, "main") else "")
        + f"{host.get('cpus', '?')} CPUs, 1 thread/rank, gloo · load average before/after "
        f"{host.get('load_before', '?')} / {host.get('load_after', '?')}"
    )
    lines.append("")
    for w in report.get("warnings", []):
        lines.append(f"> **WARNING:** {w}")
        lines.append("")
    flagged = [c for c in bound_checks(report) if c["flag"]]
    for c in flagged:
        lines.append(f"> **WARNING: {c['message']}**")
        lines.append("")
    if report.get("graphs"):
        lines.append("Graphs: " + "; ".join(
            f"{g['label']}: {g['nodes']} nodes, {g['edges']} edges, {g['features']} features"
            for g in report["graphs"].values()))
        lines.append("")
    if _runs(report, "main"):
        lines += ["## Modes side by side, each against its own bound", "", main_table(report, "main"), "",
                  MAIN_TABLE_NOTES, ""]
        if any(not r["own_bound"] and r["vs_bound"] is not None for r in main_rows(report)):
            lines += ["† no bound of this mode in the run: shown against exact-bound, which does not run this "
                      "mode's compute path (old results: `compute-only` = exact-bound).", ""]
        lines += ["## Speedup over exact (median epoch)", "", speedup_table(report, "main"), ""]
        if paired_rows(report, "main"):
            lines += ["## Round by round (paired ratios over `--repeat` rounds)", "", paired_table(report, "main"), "",
                      PAIRED_NOTES, ""]
        goals = goal_lines(report)
        if goals:
            lines += ["Goals:", "", *goals, ""]
        if report.get("calibration"):
            lines += ["## Calibrated link (communication-bound regime)", "", calibration_table(report), "",
                      CALIBRATION_NOTES, ""]
        if any(r["vs_bound"] is not None or r["wait_share"] is not None for r in comm_rows(report)):
            lines += ["## Communication share of exact's epoch", "", comm_table(report, "main"), ""]
        if peer_rows(report) or report.get("peer"):
            lines += ["## Peer: single-process PyG on the whole graph", "",
                      "The same GNNNodeClassifier (conv, hidden, layers, dropout, Adam, masked cross-entropy), plain "
                      "torch loop, one process, no strategy, no link; `edge_index` input, PyG's sparse path "
                      "(`torch.sparse_csr` adj_t), and for GCN the sparse path with `cached=True` (the normalised "
                      "adjacency reused across steps, as the distributed adapters reuse their CSR blocks).", "",
                      peer_table(report), ""]
            failed_peers = [p for p in report.get("peer") or [] if p.get("error")]
            lines += [f"- peer {p['variant']} x{p['threads']} FAILED: {p['error']}" for p in failed_peers]
            if any(p.get("self_loops") for p in peer_rows(report)):
                lines += ["> **WARNING:** the graph has self-loops: GCN normalises them differently on the sparse "
                          "path (add_self_loops vs add_remaining_self_loops); the two peer inputs are not the "
                          "same model.", ""]
            ratios = peer_ratio_lines(report)
            if ratios:
                lines += [*ratios, ""]
            lines += [side_by_side_table(report), ""]
        lines += ["## Phase breakdown (seconds per epoch, mean over ranks, median over epochs)", "",
                  phase_table(report, "main"), ""]
        lines += ["## Partition balance, halo waits and memory per rank", "", balance_table(report, "main"), ""]
        parts = partition_lines(report)
        if parts:
            lines += ["Partitions (manifest):", "", *parts, ""]
        lines += ["## CPU per rank and epoch (mean over ranks, median over epochs)", "",
                  cpu_table(report, "main"), ""]
    if scaling_rows(report):
        lines += ["## Scaling: per-rank memory and epoch time vs ranks and graph size (exact mode)", "",
                  scaling_table(report), ""]
    if _runs(report, "accuracy"):
        lines += [
            f"## Accuracy ({cfg.get('accuracy')}, {cfg.get('accuracy_epochs')} training epochs, `Trainer.test` after "
            "`fit`; time and traffic columns summarise the epochs after the first few)",
            "",
            main_table(report, "accuracy"),
            "",
        ]
    failed = [r for r in report["runs"] if r.get("error")]
    if failed:
        lines += ["## Failed runs", ""]
        lines += [f"- {r['section']} {r['graph_label']} {r['mode']} @{r['ranks']}: {r['error']}" for r in failed]
        lines.append("")
    if png_name:
        lines += [f"![plot]({png_name})", ""]
    lines += ["Reproduce: `" + report.get("command", "?") + "`", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> bool:
    """Writes the figure (mode comparison on top, scaling below, whichever the run has);
    returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    main = _runs(report, "main") or _runs(report, "accuracy")
    scal = scaling_rows(report)
    rows = int(bool(main)) + int(bool(scal)) or 1
    fig, grid = plt.subplots(rows, 2, figsize=(max(13, 0.75 * len(main) + 4), 4.5 * rows), squeeze=False)
    # unused panels go to a hidden figure: the code below stays unconditional
    spare = plt.figure().subplots(2, 2)
    axes = np.array([list(grid[0]) if main else list(spare[0]),
                     list(grid[-1]) if scal else list(spare[1])], dtype=object)
    colors = {
        "compute": "#4c72b0", "wait": "#dd8452", "quant": "#55a868", "assign": "#8172b3",
        "allreduce": "#c44e52", "optimizer": "#937860", "other": "#aaaaaa",
    }
    many_graphs = len({x["graph_key"] for x in main}) > 1
    many_groups = len({_group(x) for x in main}) > 1

    def tick(r: dict[str, Any]) -> str:
        return (f"{_mode(r)}\n{r['ranks']}r" + (f"\n{r['graph_label']}" if many_graphs else "")
                + (f"\n{_group(r).replace(' · ', chr(10)).replace('balance ', 'bal. ')}" if many_groups else ""))

    def ticks(ax: Any, rs: list[dict[str, Any]]) -> None:
        ax.set_xticks(range(len(rs)))
        crowded = len(rs) > 8
        ax.set_xticklabels([tick(r).replace("\n", " ") if crowded else tick(r) for r in rs],
                           fontsize=6 if crowded else 7, rotation=90 if crowded else 0)

    # (a) stacked phases
    ax = axes[0, 0]
    bottom = [0.0] * len(main)
    for p in PHASES:
        vals = [max(r["summary"]["phases"].get(p) or 0.0, 0.0) for r in main]
        ax.bar(range(len(main)), vals, bottom=bottom, color=colors[p], label=PHASE_LABELS[p],
               hatch=None, alpha=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(main):
        if is_bound(_mode(r)):
            ax.bar(i, bottom[i], fill=False, hatch="//", edgecolor="#555555", linewidth=0)
    ax.scatter(range(len(main)), [r["summary"]["epoch_time"] for r in main], color="k", marker="_", s=200,
               zorder=3, label="epoch (median)")
    ticks(ax, main)
    ax.set_ylabel("seconds / epoch")
    ax.set_title(f"Epoch time by phase (link {report['config'].get('link')}; hatched: bounds)")
    if main:
        ax.legend(fontsize=7)
    # (b) bytes on the wire
    ax = axes[0, 1]
    comm = [r for r in main if not is_bound(_mode(r))]
    ax.bar(range(len(comm)), [(r["summary"]["bytes_sent"] or 0) / 1e6 for r in comm],
           color=["#4c72b0" if unbound(_mode(r)).startswith("exact") else "#55a868"
                  if unbound(_mode(r)).startswith("adaqp") else "#dd8452" for r in comm])
    ticks(ax, comm)
    if any((r["summary"]["bytes_sent"] or 0) > 0 for r in comm):
        ax.set_yscale("log")
    ax.set_ylabel("MB sent per epoch (all ranks)")
    ax.set_title("Halo traffic")
    # (c) memory vs ranks, (d) epoch time vs ranks, one line per graph
    first_group = (_groups(report) or [""])[0]
    for graph_key in sorted({r["graph_key"] for r in scal}, key=lambda k: report["graphs"][k]["nodes"]):
        rs = sorted((r for r in scal if r["graph_key"] == graph_key), key=lambda r: r["ranks"])
        label = report["graphs"][graph_key]["label"]
        mline = axes[1, 0].plot([r["ranks"] for r in rs],
                                [r["summary"]["memory"]["peak_above_baseline_max"] or 0 for r in rs],
                                marker="o", label=f"{label} (above baseline)")
        axes[1, 0].plot([r["ranks"] for r in rs], [r["summary"]["memory"]["peak_rss_max"] or 0 for r in rs],
                        marker="x", linestyle=":", color=mline[0].get_color(), label=f"{label} (total RSS)")
        line = axes[1, 1].plot([r["ranks"] for r in rs], [r["summary"]["epoch_time"] for r in rs], marker="o",
                               label=f"{label} exact")
        bound = [b for b in main if b["graph_key"] == graph_key and _mode(b) == "exact-bound" and _group(b) == first_group]
        if bound:
            axes[1, 1].plot([b["ranks"] for b in bound], [b["summary"]["epoch_time"] for b in bound], marker="s",
                            linestyle="--", color=line[0].get_color(), label=f"{label} exact-bound")
        peer = [p for p in peer_rows(report) if p["graph_key"] == graph_key and p["variant"] == "sparse"]
        for p in peer:
            axes[1, 1].scatter([1], [p["summary"]["epoch_time"]], marker="*", s=90, color=line[0].get_color(),
                               label=f"{label} peer sparse x{p['threads']} thr", zorder=3)
    for ax, title, ylabel in (
        (axes[1, 0], "Peak memory per rank (exact)", "MiB (max over ranks)"),
        (axes[1, 1], "Epoch time vs ranks (exact)", "seconds / epoch"),
    ):
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({r["ranks"] for r in scal} | ({1} if peer_rows(report) else set())) or [1])
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        if scal:
            ax.legend(fontsize=7)
    fig.suptitle(f"lightning-fullgraph benchmark '{report['name']}'")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close("all")
    return True
