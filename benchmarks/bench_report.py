"""Aggregation of per-rank records, and the Markdown / PNG reports of ``benchmarks/run.py``.

Per configuration, over the *measured* epochs (those after the warm-up):

* epoch time of an epoch = the slowest rank's (ranks are synchronous; the median of these is
  ``epoch_time``, their mean ``epoch_time_mean``),
* phases of an epoch = the mean over ranks; the reported phase is the median over epochs,
* traffic of an epoch = the sum over ranks (what ``comm/bytes_sent`` logs); reported: median,
* memory = per rank (peak resident set, baseline, peak above baseline), reported as max and
  mean over ranks.
"""

from __future__ import annotations

import statistics
from typing import Any

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
MODE_ORDER = (
    "exact", "exact-overlap", "adaqp", "adaqp-nooverlap", "sylvie", "compute-only", "compute-only-overlap"
)
CPU = ("cpu_user", "cpu_sys", "cpu_main_thread", "cpu_other_threads", "minor_faults")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(results: dict[str, Any] | list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per-configuration figures from one worker result, or from repeats of the same
    configuration (their measured epochs pooled; see the module docstring)."""
    if isinstance(results, dict):
        results = [results]
    per_epoch = []
    for repeat, result in enumerate(results):
        per_epoch += _epochs(result["ranks"], warmup, repeat)
    ranks = [r for result in results for r in result["ranks"]]
    return _summary(per_epoch, ranks, len(results))


def _epochs(ranks: list[dict[str, Any]], warmup: int, repeat: int) -> list[dict[str, Any]]:
    n_epochs = min(len(r["epochs"]) for r in ranks)
    measured = list(range(min(warmup, max(n_epochs - 1, 0)), n_epochs))
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
        for k in ("wait", "quant"):
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


def _summary(per_epoch: list[dict[str, Any]], ranks: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    times = [r["epoch_time"] for r in per_epoch]
    bits_sent = sum(r.get("bits_sent", 0) for r in per_epoch)
    values_sent = sum(r.get("values_sent", 0) for r in per_epoch)
    mem = [r["memory"] for r in ranks]

    def mem_stat(key: str, fn) -> float | None:
        vals = [m[key] for m in mem if m.get(key) is not None]
        return fn(vals) if vals else None

    parts = [r["partition"] for r in ranks if r.get("partition")]
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
        "bytes_sent": _median([r["bytes_sent"] for r in per_epoch if "bytes_sent" in r]),
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
            "owned_mean": statistics.fmean(p["owned"] for p in parts) if parts else None,
            "halo_mean": statistics.fmean(p["halo"] for p in parts) if parts else None,
            "halo_max": max(p["halo"] for p in parts) if parts else None,
            "edges_mean": statistics.fmean(p["edges"] for p in parts) if parts else None,
        },
        "per_epoch": per_epoch,
    }
    if any("staleness_max" in r for r in per_epoch):
        summary["staleness_max"] = max(r.get("staleness_max", 0) for r in per_epoch)
        summary["staleness_mean"] = statistics.fmean(r.get("staleness_mean", 0.0) for r in per_epoch)
        summary["sync_epochs"] = sum(1 for r in per_epoch if r.get("sync"))
    return summary


# -- formatting ----------------------------------------------------------------------------
def _f(value: float | None, fmt: str = "{:.3f}", none: str = "–") -> str:
    return none if value is None else fmt.format(value)


def _mb(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e6:.2f}"


def _runs(report: dict[str, Any], section: str) -> list[dict[str, Any]]:
    runs = [r for r in report["runs"] if r["section"] == section and r.get("summary")]
    return sorted(runs, key=lambda r: (r["graph_key"], r["ranks"], MODE_ORDER.index(r["mode"])))


def _find(report: dict[str, Any], section: str, graph_key: str, ranks: int, mode: str) -> dict[str, Any] | None:
    for r in report["runs"]:
        if (
            r["section"] == section
            and r["graph_key"] == graph_key
            and r["ranks"] == ranks
            and r["mode"] == mode
            and r.get("summary")
        ):
            return r
    return None


def main_rows(report: dict[str, Any], section: str = "main") -> list[dict[str, Any]]:
    """Rows of the side-by-side table, with speedup over exact and ratio to the bound."""
    rows = []
    for run in _runs(report, section):
        s = run["summary"]
        exact = _find(report, section, run["graph_key"], run["ranks"], "exact")
        bound = _find(report, section, run["graph_key"], run["ranks"], "compute-only")
        t = s["epoch_time"]
        tm = s["epoch_time_mean"]
        row = {
            "run": run,
            "speedup": exact["summary"]["epoch_time"] / t if exact and t else None,
            "speedup_mean": exact["summary"]["epoch_time_mean"] / tm if exact and tm else None,
            "vs_bound": t / bound["summary"]["epoch_time"] if bound and t else None,
            "vs_bound_mean": tm / bound["summary"]["epoch_time_mean"] if bound and tm else None,
        }
        rows.append(row)
    return rows


def main_table(report: dict[str, Any], section: str = "main") -> str:
    lines = [
        "| graph | ranks | mode | epoch s (median) | epoch s (mean) | speedup vs exact | x compute-only "
        "| MB sent/epoch | bits/value | peak RSS/rank MiB (max) | above baseline MiB (max) | test acc |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in main_rows(report, section):
        run, s = row["run"], row["run"]["summary"]
        m = s["memory"]
        lines.append(
            f"| {run['graph_label']} | {run['ranks']} | {run['mode']} | {_f(s['epoch_time'])} | "
            f"{_f(s['epoch_time_mean'])} | {_f(row['speedup'], '{:.2f}x')} | {_f(row['vs_bound'], '{:.2f}x')} | "
            f"{_mb(s['bytes_sent'])} | {_f(s['bits'], '{:.2f}')} | {_f(m['peak_rss_max'], '{:.0f}')} | "
            f"{_f(m['peak_above_baseline_max'], '{:.0f}')} | {_f(run.get('test_acc'), '{:.4f}')} |"
        )
    return "\n".join(lines)


def phase_table(report: dict[str, Any], section: str = "main") -> str:
    head = " | ".join(PHASE_LABELS[p] for p in PHASES)
    lines = [
        f"| graph | ranks | mode | epoch s | {head} | halo wait, most-waiting rank | wire s (bytes / link rate) |",
        "|---|---:|---|---:|" + "---:|" * (len(PHASES) + 2),
    ]
    for run in _runs(report, section):
        s = run["summary"]
        cells = " | ".join(_f(s["phases"].get(p)) for p in PHASES)
        lines.append(
            f"| {run['graph_label']} | {run['ranks']} | {run['mode']} | {_f(s['epoch_time'])} | {cells} | "
            f"{_f(s.get('wait_max_rank'))} | {_f(wire_seconds(run))} |"
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
    lines = [
        "| graph | ranks | mode | epoch s (wall) | CPU user s | CPU sys s | main thread CPU s | other threads CPU s "
        "| minor page faults |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in _runs(report, section):
        s = run["summary"]
        c = s.get("cpu") or {}
        lines.append(
            f"| {run['graph_label']} | {run['ranks']} | {run['mode']} | {_f(s['epoch_time'])} | "
            f"{_f(c.get('cpu_user'))} | {_f(c.get('cpu_sys'))} | {_f(c.get('cpu_main_thread'))} | "
            f"{_f(c.get('cpu_other_threads'))} | {_f(c.get('minor_faults'), '{:.0f}')} |"
        )
    return "\n".join(lines)


def scaling_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    seen = set()
    for run in report["runs"]:
        if run["mode"] != "exact" or not run.get("summary") or run["section"] not in ("main", "scaling"):
            continue
        key = (run["graph_key"], run["ranks"])
        if key in seen:
            continue
        seen.add(key)
        rows.append(run)
    return sorted(rows, key=lambda r: (r["graph_nodes"], r["ranks"]))


def scaling_table(report: dict[str, Any]) -> str:
    lines = [
        "| graph | nodes | ranks | epoch s (median) | compute-only epoch s | owned nodes/rank | halo nodes/rank "
        "| baseline RSS MiB | peak RSS/rank MiB (max) | above baseline MiB (max) | above baseline MiB (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in scaling_rows(report):
        s = run["summary"]
        m = s["memory"]
        p = s["partition"]
        bound = _find(report, "main", run["graph_key"], run["ranks"], "compute-only")
        lines.append(
            f"| {run['graph_label']} | {run['graph_nodes']} | {run['ranks']} | {_f(s['epoch_time'])} | "
            f"{_f(bound['summary']['epoch_time'] if bound else None)} | {_f(p['owned_mean'], '{:.0f}')} | "
            f"{_f(p['halo_mean'], '{:.0f}')} | {_f(m['rss_baseline_mean'], '{:.0f}')} | "
            f"{_f(m['peak_rss_max'], '{:.0f}')} | {_f(m['peak_above_baseline_max'], '{:.0f}')} | "
            f"{_f(m['peak_above_baseline_mean'], '{:.0f}')} |"
        )
    return "\n".join(lines)


def goal_lines(report: dict[str, Any]) -> list[str]:
    """The issue's goals, checked on the largest rank count of the main section."""
    out = []
    rows = main_rows(report)
    if not rows:
        return out
    for graph_key in sorted({r["run"]["graph_key"] for r in rows}):
        ranks = max(r["run"]["ranks"] for r in rows if r["run"]["graph_key"] == graph_key)
        by_mode = {r["run"]["mode"]: r for r in rows if r["run"]["graph_key"] == graph_key and r["run"]["ranks"] == ranks}
        label = next(iter(by_mode.values()))["run"]["graph_label"]
        head = f"{label}, {ranks} ranks, link {report['config']['link']}"
        if "sylvie" in by_mode and by_mode["sylvie"]["vs_bound"] is not None:
            r = by_mode["sylvie"]
            ok = r["vs_bound"] <= 1.3
            out.append(
                f"- {head}: sylvie / compute-only = {r['vs_bound']:.2f}x (median epoch; "
                f"{_f(r['vs_bound_mean'], '{:.2f}x')} on the mean, which counts its synchronous epochs) "
                f"— goal <= 1.3x: **{'met' if ok else 'NOT met'}**"
            )
        if "adaqp" in by_mode and by_mode["adaqp"]["speedup"] is not None:
            r = by_mode["adaqp"]
            ok = r["speedup"] >= 2.0
            out.append(
                f"- {head}: adaqp speedup over exact = {r['speedup']:.2f}x (median; "
                f"{_f(r['speedup_mean'], '{:.2f}x')} on the mean) — goal >= 2x: **{'met' if ok else 'NOT met'}**"
            )
        if "exact" in by_mode and by_mode["exact"]["vs_bound"] is not None:
            r = by_mode["exact"]
            out.append(f"- {head}: exact / compute-only = {r['vs_bound']:.2f}x (the gap compression attacks)")
    return out


def markdown(report: dict[str, Any], png_name: str | None) -> str:
    cfg = report["config"]
    lines = [f"# Benchmark `{report['name']}`", ""]
    lines.append(
        f"{report['created']} · {cfg['conv']} x{cfg['layers']} hidden {cfg['hidden']} · malloc {cfg.get('malloc', 'default')}"
        f" · link **{cfg['link']}**"
        f" ({report['link']['description']}) · "
        + (f"{cfg['warmup']} warm-up + {cfg['epochs']} measured epochs"
           + (f" x {cfg['repeat']} rounds" if (cfg.get("repeat") or 1) > 1 else "") + " · "
           if _runs(report, "main") else "")
        + f"{report['host']['cpus']} CPUs, 1 thread/rank, gloo · load average before/after "
        f"{report['host'].get('load_before', '?')} / {report['host'].get('load_after', '?')}"
    )
    lines.append("")
    for w in report.get("warnings", []):
        lines.append(f"> **WARNING:** {w}")
        lines.append("")
    lines.append("Graphs: " + "; ".join(
        f"{g['label']}: {g['nodes']} nodes, {g['edges']} edges, {g['features']} features"
        for g in report["graphs"].values()))
    lines.append("")
    if _runs(report, "main"):
        lines += ["## Modes side by side", "", main_table(report, "main"), ""]
        goals = goal_lines(report)
        if goals:
            lines += ["Goals:", "", *goals, ""]
        lines += ["## Phase breakdown (seconds per epoch, mean over ranks, median over epochs)", "",
                  phase_table(report, "main"), ""]
        lines += ["## CPU per rank and epoch (mean over ranks, median over epochs)", "",
                  cpu_table(report, "main"), ""]
    if scaling_rows(report):
        lines += ["## Scaling: per-rank memory and epoch time vs ranks and graph size (exact mode)", "",
                  scaling_table(report), ""]
    if _runs(report, "accuracy"):
        lines += [
            f"## Accuracy ({cfg['accuracy']}, {cfg['accuracy_epochs']} training epochs, `Trainer.test` after `fit`; "
            "time and traffic columns summarise the epochs after the first few)",
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
    lines += ["Reproduce: `" + report["command"] + "`", ""]
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
    fig, grid = plt.subplots(rows, 2, figsize=(13, 4.5 * rows), squeeze=False)
    # unused panels go to a hidden figure: the code below stays unconditional
    spare = plt.figure().subplots(2, 2)
    axes = np.array([list(grid[0]) if main else list(spare[0]),
                     list(grid[-1]) if scal else list(spare[1])], dtype=object)
    colors = {
        "compute": "#4c72b0", "wait": "#dd8452", "quant": "#55a868", "assign": "#8172b3",
        "allreduce": "#c44e52", "optimizer": "#937860", "other": "#aaaaaa",
    }
    # (a) stacked phases
    ax = axes[0, 0]
    labels = [f"{r['mode']}\n{r['ranks']}r" + ("" if len({x['graph_key'] for x in main}) == 1 else f"\n{r['graph_label']}")
              for r in main]
    bottom = [0.0] * len(main)
    for p in PHASES:
        vals = [max(r["summary"]["phases"].get(p) or 0.0, 0.0) for r in main]
        ax.bar(range(len(main)), vals, bottom=bottom, color=colors[p], label=PHASE_LABELS[p])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(range(len(main)), [r["summary"]["epoch_time"] for r in main], color="k", marker="_", s=200,
               zorder=3, label="epoch (median)")
    ax.set_xticks(range(len(main)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("seconds / epoch")
    ax.set_title(f"Epoch time by phase (link {report['config']['link']})")
    if main:
        ax.legend(fontsize=7)
    # (b) bytes on the wire
    ax = axes[0, 1]
    comm = [r for r in main if not r["mode"].startswith("compute-only")]
    ax.bar(range(len(comm)), [(r["summary"]["bytes_sent"] or 0) / 1e6 for r in comm],
           color=["#4c72b0" if r["mode"].startswith("exact") else "#55a868" if r["mode"].startswith("adaqp") else "#dd8452" for r in comm])
    ax.set_xticks(range(len(comm)))
    ax.set_xticklabels([f"{r['mode']}\n{r['ranks']}r" for r in comm], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MB sent per epoch (all ranks)")
    ax.set_title("Halo traffic")
    # (c) memory vs ranks, (d) epoch time vs ranks, one line per graph
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
        bound = [b for b in main if b["graph_key"] == graph_key and b["mode"] == "compute-only"]
        if bound:
            axes[1, 1].plot([b["ranks"] for b in bound], [b["summary"]["epoch_time"] for b in bound], marker="s",
                            linestyle="--", color=line[0].get_color(), label=f"{label} compute-only")
    for ax, title, ylabel in (
        (axes[1, 0], "Peak memory per rank (exact)", "MiB (max over ranks)"),
        (axes[1, 1], "Epoch time vs ranks (exact)", "seconds / epoch"),
    ):
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({r["ranks"] for r in scal}) or [1])
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
