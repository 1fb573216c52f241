"""Smoke test of ``benchmarks/run.py``: a tiny community graph, 2 ranks, 2 epochs, no link
throttling.  Checks that the JSON, Markdown and PNG reports are written with sane fields;
never asserts wall times (they depend on the machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"


def _load(name: str):
    sys.path.insert(0, str(RUN.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, RUN.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(RUN.parent))


def test_link_wrapper_and_tc_parsing() -> None:
    run = _load("run")
    assert run.link_wrapper("none", "shared", 4) == ([], "no throttling (host loopback)")
    prefix, desc = run.link_wrapper("1gbit", "shared", 4)
    assert prefix[:3] == ["unshare", "-n", "bash"]
    assert "tbf rate 1000000000bit burst 125000b latency 50ms" in prefix[4]
    prefix, _ = run.link_wrapper("10gbit", "per-rank", 4)
    assert "tbf rate 40000000000bit burst 5000000b" in prefix[4]
    stats = run.parse_tc_stats(
        "qdisc tbf 8001: root refcnt 2 rate 1Gbit burst 125000b lat 50ms\n"
        " Sent 553013712 bytes 22280 pkt (dropped 31, overlimits 20299 requeues 0)\n"
    )
    assert stats == {"bytes": 553013712, "packets": 22280, "dropped": 31, "overlimits": 20299}


@pytest.mark.timeout(240)
def test_benchmark_smoke(tmp_path) -> None:
    cmd = [
        sys.executable, str(RUN), "--name", "smoke", "--graph", "community", "--nodes", "600",
        "--hidden", "16", "--ranks", "2", "--modes", "exact,sylvie", "--link", "none",
        "--warmup", "1", "--epochs", "1", "--no-scaling", "--accuracy", "", "--timeout", "180",
        "--out-dir", str(tmp_path / "results"), "--cache-dir", str(tmp_path / "cache"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((tmp_path / "results" / "smoke.json").read_text())
    assert report["config"]["link"] == "none"
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"exact", "sylvie"}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        s = run["summary"]
        assert run["ranks"] == 2 and s["epochs_measured"] == 1
        assert s["epoch_time"] > 0
        assert all(v is None or v >= -1e-3 for k, v in s["phases"].items() if k != "other"), s["phases"]
        m = s["memory"]
        assert m["peak_rss_max"] > 0 and m["rss_baseline_mean"] > 0
        assert m["peak_rss_max"] >= m["rss_baseline_mean"]
        assert len(run["ranks_detail"]) == 2
        assert s["partition"]["owned_mean"] == 300
    assert runs["exact"]["summary"]["bytes_sent"] > 0
    assert runs["exact"]["summary"]["bits"] == 32
    assert runs["sylvie"]["summary"]["bits"] == 1
    assert runs["sylvie"]["summary"]["bytes_sent"] < runs["exact"]["summary"]["bytes_sent"]

    md = (tmp_path / "results" / "smoke.md").read_text()
    assert "## Modes side by side" in md and "| community 600 | 2 | sylvie |" in md
    assert "Phase breakdown" in md

    png = tmp_path / "results" / "smoke.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in json.dumps(report["warnings"])
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
