"""Records the trajectories ``tests/distributed/test_recorded_trajectories.py`` compares against.

A recording is bitwise only on a host that rounds float32 the same way: two CPUs (an AMD EPYC
with AVX2 and the host of the first recordings) run other matmul and reduction kernels and end
7 epochs apart in the last bits (3e-8 to 6e-8 measured). So each recording lives in a folder named by the
recording host's :func:`host_key`, ``trajectories/<key>/``, holding per mode ``<mode>.pt``
(weights after :data:`EPOCHS` epochs on 3 ranks), ``<mode>-epoch4.ckpt`` (the checkpoint after
epoch :data:`STOP_AFTER`, written by the stopped run) and ``host.json`` (the key, the CPU, torch,
the date).

``python tests/data/record_trajectories.py`` records this host's folder. Where other hosts'
recordings exist it first checks that this host's weights are within :data:`TOLERANCE` of
theirs, so adding a host cannot also record a change of behaviour; ``--replace-all`` is for a
change MEANT to alter training: it deletes the other hosts' recordings (stale from then on) and
records this one. Mode names record those modes only (``... record_trajectories.py adaqp``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

if __name__ == "__main__":  # run as a script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fullgraph import FullGraphDataModule  # noqa: E402
from tests.helpers import PIPELINED, NodeClassifier, cpu_trainer, directed_graph  # noqa: E402

RECORDS = Path(__file__).resolve().parent / "trajectories"
HOST_FILE = "host.json"
EPOCHS = 7
STOP_AFTER = 4
#: Largest weight difference (absolute) accepted between hosts. Measured: another CPU's
#: rounding moves the 7-epoch weights by at most 6e-8; seeding the rounding stream one off moves
#: the compressed modes' by 0.04-0.13. A change of summation order alone stays below it: only
#: a host's own recording sees that.
TOLERANCE = 1e-5
MODES = {
    "exact": {"mode": "exact"},
    "adaqp": {"mode": "adaqp", "first_assign": 2, "assign_every": 2, "group_size": 4, "link_costs": "uniform"},
    "adaqp-4bit": {"mode": "adaqp", "bits": 4},
    "sylvie": {"mode": "sylvie"},
    "sylvie-pipelined": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5},
    "sylvie-adaptive": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5, "epoch_adaptive": True,
                        "adaptive_window": 2},
}


def host_key() -> str:
    """Names how this host computes the trajectories' float32 kernels: torch's CPU capability
    and twelve hex digits of a hash over the bits of a fixed computation (matmuls and linear
    layers at several shapes, row and column sums, ``log_softmax``, ``index_add_``, three Adam
    steps) and the torch version. Two hosts with one key round those kernels alike.

    Every tensor stays under 32,768 elements, so the result does not depend on how many threads
    a reduction is split over."""
    generator = torch.Generator().manual_seed(0)
    outputs: list[torch.Tensor] = []
    for n, k, m in ((300, 16, 16), (300, 32, 7), (250, 64, 64), (37, 129, 33)):
        a = torch.randn(n, k, generator=generator)
        b = torch.randn(k, m, generator=generator)
        bias = torch.randn(m, generator=generator)
        product = a @ b
        rows = torch.randint(0, n, (4 * n,), generator=generator)
        targets = torch.randint(0, n, (4 * n,), generator=generator)
        outputs += [product, torch.nn.functional.linear(a, b.T, bias), a.sum(0), a.sum(1), a.mean(1),
                    torch.log_softmax(product, dim=1), torch.zeros(n, k).index_add_(0, targets, a[rows])]
    weight = torch.randn(64, 16, generator=generator).requires_grad_()
    optimizer = torch.optim.Adam([weight], lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        (torch.log_softmax(weight @ weight.T, dim=1).sum() + weight.exp().mean()).backward()
        optimizer.step()
    outputs.append(weight.detach())
    digest = hashlib.sha256(torch.__version__.encode())
    for tensor in outputs:
        digest.update(tensor.contiguous().numpy().tobytes())
    return f"{torch.backends.cpu.get_cpu_capability().lower()}-{digest.hexdigest()[:12]}"


def recordings() -> dict[str, Path]:
    """The recorded hosts' folders by key (a folder recorded before keys were stored has a
    ``host.json`` whose key is null; it is listed under its folder name and matches no host)."""
    found = {}
    for folder in sorted(RECORDS.iterdir()) if RECORDS.is_dir() else []:
        host_file = folder / HOST_FILE
        if host_file.is_file():
            found[json.loads(host_file.read_text())["key"] or folder.name] = folder
    return found


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class _StopAfter(pl.Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def fit(tmp_path: Path, mode: str, *, resume: Path | None = None, checkpoint_dir: Path | None = None,
        stop_after: int | None = None, settings: dict | None = None) -> dict[str, torch.Tensor]:
    """Trains ``mode`` (3 ranks, GraphSAGE 3 layers, Adam) and returns the final weights;
    ``settings`` are strategy arguments on top of the mode's."""
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, optimizer="adam", lr=0.01)
    callbacks: list = []
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, save_top_k=0))
    if stop_after is not None:
        callbacks.append(_StopAfter(stop_after))
    trainer = cpu_trainer(3, max_epochs=EPOCHS, callbacks=callbacks, enable_checkpointing=checkpoint_dir is not None,
                          strategy_kwargs={**MODES[mode], **(settings or {})})
    trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "parts"),
                ckpt_path=None if resume is None else str(resume))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def largest_difference(weights: dict[str, torch.Tensor], recorded: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over every weight (``inf`` where the keys or shapes differ)."""
    if weights.keys() != recorded.keys() or any(weights[k].shape != recorded[k].shape for k in recorded):
        return float("inf")
    return max(float((weights[k] - recorded[k]).abs().max()) for k in recorded)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", help=f"modes to record (default all: {', '.join(MODES)})")
    parser.add_argument("--replace-all", action="store_true",
                        help="a change MEANT to alter training: delete the other hosts' recordings of these modes")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; recorded modes: {list(MODES)}")
    modes = args.modes or list(MODES)
    key = host_key()
    others = {k: folder for k, folder in recordings().items() if k != key}
    target = RECORDS / key
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            weights = fit(tmp_path / "full", mode)
            for other, folder in others.items():
                if args.replace_all or not (folder / f"{mode}.pt").is_file():
                    continue
                gap = largest_difference(weights, torch.load(folder / f"{mode}.pt", weights_only=True))
                if gap > TOLERANCE:
                    raise SystemExit(
                        f"{mode}: this host's weights differ from host {other}'s recording by {gap:.3g} "
                        f"(> {TOLERANCE:g}, more than another CPU's rounding): the code's behaviour changed. "
                        "If that change is meant, re-record with --replace-all and say so in CHANGELOG.")
            target.mkdir(parents=True, exist_ok=True)
            torch.save(weights, target / f"{mode}.pt")
            fit(tmp_path / "part", mode, checkpoint_dir=tmp_path / "ckpt", stop_after=STOP_AFTER)
            shutil.copy(tmp_path / "ckpt" / "last.ckpt", target / f"{mode}-epoch4.ckpt")
        if args.replace_all:
            for folder in others.values():
                for stale in (folder / f"{mode}.pt", folder / f"{mode}-epoch4.ckpt"):
                    stale.unlink(missing_ok=True)
        print(f"recorded {mode} for host {key}")
    (target / HOST_FILE).write_text(json.dumps(
        {"key": key, "cpu": _cpu_name(), "torch": torch.__version__, "recorded": time.strftime("%Y-%m-%d")},
        indent=1) + "\n")
    if args.replace_all:
        for folder in others.values():
            if not any(folder.glob("*.pt")):
                shutil.rmtree(folder)


if __name__ == "__main__":
    main(sys.argv[1:])
