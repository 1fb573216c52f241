"""Regenerate the figures and the numbers of ``docs/tutorial.md``.

Runs the tutorial's three ``fit`` commands (Cora, GCN 2x16, 2 CPU ranks, 200 epochs; modes
exact, adaqp, sylvie) one after the other from the repository root, exactly as the page shows
them, then reads their TensorBoard event files and writes:

* ``docs/img/tutorial_scalars.png``: TensorBoard's Time Series dashboard on the three runs.
  With Chromium on ``PATH`` (``chromium``, ``chromium-browser``, ``google-chrome``, or
  ``$CHROME``) it is a real screenshot: this script starts ``tensorboard`` and a headless
  Chromium and captures the page.  Without one, or with ``--scalars render``, it is a matplotlib
  rendering of the same event files (one panel per scalar tag, the runs overlaid), titled as
  such.  The script prints which one it wrote.
* ``docs/img/accuracy_vs_bytes.png``: validation accuracy per epoch against the cumulative
  bytes sent (``comm/bytes_sent`` summed over epochs), and the final test accuracy at the
  run's total.
* the measured numbers as a markdown table, printed (and written to ``--table`` if given).

Usage, from anywhere (about 1 minute on 2 idle CPU cores, 2.5 minutes on loaded ones)::

    python docs/make_tutorial.py
    python docs/make_tutorial.py --clean                  # replace earlier runs in runs/tutorial
    python docs/make_tutorial.py --skip-fit               # figures again from the existing runs
    python docs/make_tutorial.py --print-commands         # the three commands, nothing run

Needs matplotlib and tensorboard: ``pip install matplotlib tensorboard`` (or
``pip install -e ".[docs]"``).  The runs need the offline Cora copy the config points at
(``../shared/datasets/Planetoid`` from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMG = REPO / "docs" / "img"
MODES = ("exact", "adaqp", "sylvie")
DEFAULT_LOGDIR = "runs/tutorial"
CONFIG = "examples/configs/cora_gcn.yaml"
#: Tags shown in the screenshot (TensorBoard's tag filter), in TensorBoard's order.
SCREENSHOT_TAGS = ("comm/bits", "comm/bytes_sent", "comm/wire_bits", "train_loss", "val_acc", "val_loss")
#: TensorBoard's default run colours for the first three runs (alphabetical: adaqp, exact, sylvie).
COLORS = {"adaqp": "#12b5cb", "exact": "#425066", "sylvie": "#e52592"}
TIMINGS = "timings.json"


def commands(logdir: str = DEFAULT_LOGDIR) -> list[str]:
    """The tutorial's ``fit`` commands, one per mode, as shell lines run from the repository root."""
    return [
        f"python -m lightning_fullgraph fit --config {CONFIG} --trainer.strategy=fullgraph_{mode} "
        f"--trainer.logger=TensorBoardLogger --trainer.logger.save_dir={logdir} --trainer.logger.name={mode}"
        for mode in MODES
    ]


def tensorboard_command(logdir: str = DEFAULT_LOGDIR) -> str:
    return f"tensorboard --logdir {logdir}"


# ------------------------------------------------------------------------------------ runs
def run_fits(logdir: str) -> dict[str, float]:
    """Runs :func:`commands` from the repository root; returns the wall time of each."""
    root = REPO / logdir
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    for mode, line in zip(MODES, commands(logdir)):
        argv = shlex.split(line)
        argv[0] = sys.executable  # "python" on the page: the interpreter running this script
        log = root / f"{mode}.log"
        print(f"[{mode}] {line}\n        output: {log}", flush=True)
        start = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        timings[mode] = time.perf_counter() - start
        if proc.returncode != 0:
            tail = log.read_text()[-3000:]
            raise SystemExit(f"[{mode}] exited with {proc.returncode}; the end of {log}:\n{tail}")
        print(f"[{mode}] done in {timings[mode]:.1f} s", flush=True)
    (root / TIMINGS).write_text(json.dumps(timings, indent=1))
    return timings


def run_dir(logdir: str, mode: str) -> Path:
    versions = sorted((REPO / logdir / mode).glob("version_*"), key=lambda p: int(p.name.split("_")[-1]))
    if not versions:
        raise SystemExit(f"no run of {mode} under {REPO / logdir / mode}: run without --skip-fit")
    if len(versions) > 1:
        raise SystemExit(f"{len(versions)} runs of {mode} under {REPO / logdir / mode}: pass --clean")
    return versions[0]


def read_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of one run folder (all its event files), as ``(step, value)`` lists."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# --------------------------------------------------------------------------------- numbers
def summarize(scalars: dict[str, list[tuple[int, float]]], seconds: float | None) -> dict[str, float | None]:
    """The table's row of one run (see the tutorial for the definitions)."""
    sent = [v for _, v in scalars["comm/bytes_sent"]]
    bits = [b for (_, b), s in zip(scalars["comm/bits"], sent) if s > 0]
    return {
        "test_acc": scalars["test_acc"][-1][1],
        "mb_sent": sum(sent) / 1e6,
        "control_mb": sum(v for _, v in scalars.get("comm/control_bytes", [])) / 1e6,
        "bits": sum(bits) / len(bits) if bits else 0.0,
        "epochs": len(sent),
        "epochs_sending": len(bits),
        "seconds": seconds,
    }


def markdown_table(rows: dict[str, dict[str, float | None]]) -> str:
    exact_mb = rows["exact"]["mb_sent"]
    lines = [
        "| mode | test acc | MB sent (Σ `comm/bytes_sent`) | vs exact | bits/value (mean `comm/bits`) | wall time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, r in rows.items():
        ratio = "1x" if mode == "exact" else f"{exact_mb / r['mb_sent']:.1f}x fewer" if r["mb_sent"] else "–"
        wall = f"{r['seconds']:.0f} s" if r["seconds"] is not None else "–"
        lines.append(
            f"| {mode} | {r['test_acc']:.3f} | {r['mb_sent']:.2f} | {ratio} | {r['bits']:.2f} | {wall} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------- figures
def plot_accuracy_vs_bytes(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=100)
    for mode, scalars in runs.items():
        sent = dict(scalars["comm/bytes_sent"])
        total, cumulative = 0.0, {}
        for step in sorted(sent):
            total += sent[step]
            cumulative[step] = total / 1e6
        val = [(cumulative[s], v) for s, v in scalars["val_acc"] if s in cumulative and cumulative[s] > 0]
        ax.plot(*zip(*val), color=COLORS[mode], lw=1.3, alpha=0.8, label=f"{mode}: val_acc after each epoch")
        test = scalars["test_acc"][-1][1]
        ax.plot([total / 1e6], [test], marker="*", ms=14, color=COLORS[mode], mec="black", ls="none")
        ax.annotate(
            f"{mode}\ntest {test:.3f}\n{total / 1e6:.2f} MB",
            (total / 1e6, test),
            textcoords="offset points",
            xytext=(0, 11),
            ha="center",
            fontsize=8,
        )
    ax.plot(
        [], [], marker="*", ms=12, color="grey", mec="black", ls="none", label="test_acc of the final weights"
    )
    ax.set_xscale("log")
    ax.set_xlabel("MB sent so far by all ranks: cumulative Σ comm/bytes_sent (layer messages, fwd + bwd)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.5, 0.93)
    ax.set_title("Cora, GCN 2x16, 2 CPU ranks, 200 epochs: accuracy vs bytes sent", fontsize=10)
    ax.grid(True, which="both", color="#e0e0e0", lw=0.6)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def render_scalars(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> None:
    """A TensorBoard-like grid of every scalar tag (not a screenshot: the title says so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = sorted({t for s in runs.values() for t in s} - {"epoch", "hp_metric"})
    cols = 5
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 2.1 * rows), dpi=70, squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        for mode, scalars in runs.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, color=COLORS[mode], lw=1.0, marker="o" if len(steps) == 1 else None)
        ax.set_title(tag, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(True, color="#e0e0e0", lw=0.6)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=COLORS[m], lw=2) for m in runs]
    fig.legend(handles, [f"{m}/version_0" for m in runs], loc="upper right", ncol=len(runs), fontsize=9)
    fig.suptitle(
        "Rendering of the TensorBoard event files with matplotlib (not a browser screenshot); "
        "x: step (= epoch)",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out)
    plt.close(fig)


# ------------------------------------------------------------------------------ screenshot
def find_chromium() -> str | None:
    names = [
        os.environ.get("CHROME"),
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def screenshot_tensorboard(
    logdir: str, out: Path, chromium: str, width: int = 1500, height: int = 1060
) -> None:
    """``tensorboard --logdir`` + headless Chromium driven over the DevTools protocol."""
    import aiohttp  # a dependency of torch_geometric

    tb_port, cdp_port = _free_port(), _free_port()
    profile = tempfile.mkdtemp(prefix="tutorial-chromium-")
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tensorboard.main",
                    "--logdir",
                    str(REPO / logdir),
                    "--port",
                    str(tb_port),
                    "--host",
                    "127.0.0.1",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        base = f"http://127.0.0.1:{tb_port}"

        def loaded():
            tags = _get_json(f"{base}/data/plugin/scalars/tags")
            return len(tags) == len(MODES) and all("val_acc" in t for t in tags.values())

        _wait("tensorboard to load the runs", loaded)
        flags = [
            "--headless=new",
            "--hide-scrollbars",
            f"--remote-debugging-port={cdp_port}",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.insert(0, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        procs.append(
            subprocess.Popen([chromium, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        targets = _wait("chromium", lambda: _get_json(f"http://127.0.0.1:{cdp_port}/json/list"))
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        tag_filter = urllib.parse.quote("^(" + "|".join(SCREENSHOT_TAGS) + ")$", safe="")
        # smoothing=0: the raw values; forceSVG: lines drawn as SVG (no WebGL needed headless)
        url = f"{base}/?tagFilter={tag_filter}&smoothing=0&forceSVG=true#timeseries"
        png = asyncio.run(_capture(aiohttp, ws_url, url, width, height))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
    out.write_bytes(png)


async def _capture(aiohttp, ws_url: str, url: str, width: int, height: int) -> bytes:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        counter = 0

        async def call(method: str, **params):
            nonlocal counter
            counter += 1
            await ws.send_json({"id": counter, "method": method, "params": params})
            while True:
                message = await ws.receive_json()
                if message.get("id") == counter:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message["result"]

        async def evaluate(expression: str):
            return (await call("Runtime.evaluate", expression=expression, returnByValue=True))["result"].get(
                "value"
            )

        await call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        await call("Page.navigate", url=url)
        # Every card drawn: as many line charts as tags, and the SVG stops changing.
        cards = "document.querySelectorAll('scalar-card-component svg path').length"
        last, stable = -1, 0
        for _ in range(120):
            await asyncio.sleep(0.5)
            count = await evaluate(cards) or 0
            stable = stable + 1 if count == last and count > 0 else 0
            last = count
            if stable >= 4:
                break
        else:
            raise RuntimeError("the TensorBoard charts did not finish drawing")
        # Close the settings side pane (it is open on a wide window) and let the cards re-layout.
        await evaluate(
            "(() => { const b = document.querySelector('button[aria-label=\"Toggle settings side pane\"]');"
            " if (b && document.querySelector('metrics-dashboard-right-pane')) b.click(); })()"
        )
        await asyncio.sleep(3)
        shot = await call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])


def shrink_png(path: Path, limit: int = 300_000) -> None:
    """Re-encode as a 256-colour palette PNG if the file is above ``limit`` bytes."""
    if path.stat().st_size <= limit:
        return
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--logdir",
        default=DEFAULT_LOGDIR,
        help=f"folder of the runs, relative to the repository root (default {DEFAULT_LOGDIR})",
    )
    parser.add_argument("--img-dir", type=Path, default=IMG, help=f"where the PNGs go (default {IMG})")
    parser.add_argument("--table", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--clean", action="store_true", help="delete earlier runs of the three modes first")
    parser.add_argument("--skip-fit", action="store_true", help="reuse the runs already in --logdir")
    parser.add_argument(
        "--scalars",
        choices=("auto", "screenshot", "render"),
        default="auto",
        help="tutorial_scalars.png: a TensorBoard screenshot (needs Chromium), a matplotlib "
        "rendering, or the screenshot when Chromium is found (default)",
    )
    parser.add_argument("--print-commands", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)

    if args.print_commands:
        print("\n".join([*commands(args.logdir), tensorboard_command(args.logdir)]))
        return 0
    try:
        import matplotlib  # noqa: F401
        import tensorboard  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"{err.name} is missing: pip install matplotlib tensorboard") from err

    root = REPO / args.logdir
    if not args.skip_fit:
        earlier = [root / m for m in MODES if (root / m).exists()]
        if earlier and not args.clean:
            raise SystemExit(
                f"earlier runs in {root} ({', '.join(p.name for p in earlier)}): "
                "pass --clean to delete them, or another --logdir"
            )
        for path in earlier:
            shutil.rmtree(path)
        timings: dict[str, float] = run_fits(args.logdir)
    else:
        timing_file = root / TIMINGS
        timings = json.loads(timing_file.read_text()) if timing_file.exists() else {}

    runs = {mode: read_scalars(run_dir(args.logdir, mode)) for mode in MODES}
    args.img_dir.mkdir(parents=True, exist_ok=True)
    scalars_png = args.img_dir / "tutorial_scalars.png"
    chromium = find_chromium()
    if args.scalars == "screenshot" and chromium is None:
        raise SystemExit("--scalars screenshot: no chromium / google-chrome on PATH (or set $CHROME)")
    if args.scalars != "render" and chromium is not None:
        screenshot_tensorboard(args.logdir, scalars_png, chromium)
        kind = f"a TensorBoard screenshot (headless {Path(chromium).name})"
    else:
        render_scalars(runs, scalars_png)
        kind = (
            "a matplotlib rendering of the event files (no Chromium found)"
            if chromium is None
            else "a matplotlib rendering of the event files (--scalars render)"
        )
    shrink_png(scalars_png)
    accuracy_png = args.img_dir / "accuracy_vs_bytes.png"
    plot_accuracy_vs_bytes(runs, accuracy_png)
    shrink_png(accuracy_png)

    table = markdown_table({m: summarize(runs[m], timings.get(m)) for m in MODES})
    print(f"\n{scalars_png}: {kind}, {scalars_png.stat().st_size // 1000} KB")
    print(f"{accuracy_png}: {accuracy_png.stat().st_size // 1000} KB\n")
    print(table)
    if args.table is not None:
        args.table.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
