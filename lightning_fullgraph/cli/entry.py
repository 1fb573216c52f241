"""The entry point :func:`main`: help, dispatch to the subcommands, a configuration error's exit status.

``partition`` goes to :func:`~lightning_fullgraph.cli.partition.partition_main`, the others to
:class:`~lightning_fullgraph.cli.train.FullGraphCLI`; a :class:`ConfigurationError` is printed in
two lines and exits with status 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fullgraph._warnings import leafspec_filter
from lightning_fullgraph.cli.errors import ConfigurationError
from lightning_fullgraph.cli.names import DEBUG_ENV, MODULE_PROG, PROG
from lightning_fullgraph.cli.partition import partition_main
from lightning_fullgraph.cli.train import DEFAULT_MODEL, TRAINER_DEFAULTS, FullGraphCLI

_SUBCOMMAND_HELP = {
    "fit": "Train a model (then test it, unless --test_after_fit=false).",
    "validate": "Evaluate a model on the validation nodes.",
    "test": "Evaluate a model on the test nodes.",
    "predict": "Compute per-node outputs (optionally saved with --predictions_path).",
    "partition": "Partition a graph into the cache ahead of training and print per-part statistics.",
}


def _invoked_as() -> str:
    """How the user started this command: ``python -m lightning_fullgraph`` (``sys.argv[0]`` is
    this package's ``__main__.py``) or :data:`PROG` (the console script, or ``main()`` called
    from Python)."""
    first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if first.name == "__main__.py" and first.parent.name == "lightning_fullgraph":
        return MODULE_PROG
    return PROG


def _parser_kwargs(prog: str) -> dict[str, Any]:
    """LightningCLI ``parser_kwargs`` of :func:`main`: the program name of the usage lines, and
    parse errors raised (then summarized) instead of printed after the whole usage."""
    return {
        "prog": prog,
        "exit_on_error": False,
        **{s: {"exit_on_error": False} for s in FullGraphCLI.subcommands()},
    }


def _help(prog: str = PROG) -> str:
    width = max(len(s) for s in _SUBCOMMAND_HELP)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, text in _SUBCOMMAND_HELP.items())
    defaults = ", ".join(f"{k}={v}" for k, v in TRAINER_DEFAULTS.items())
    also = PROG if prog == MODULE_PROG else MODULE_PROG
    return f"""usage: {prog} {{fit,validate,test,predict,partition}} [options]

Distributed full-graph GNN training with PyTorch Lightning (also: {also}).

subcommands:
{commands}

Add --help after a subcommand for its options, e.g. `{prog} fit --help`.
fit/validate/test/predict are LightningCLI subcommands: configure them with --config FILE.yaml
and/or dotted flags (--trainer.*, --model.*, --data.*); --print_config shows the full config.
Model: any LightningModule via --model.class_path (default {DEFAULT_MODEL});
data: lightning_fullgraph.FullGraphDataModule (default: the embedded "community" graph).
Trainer defaults: {defaults}.
Each run logs to lightning_logs/version_N/ (config.yaml, TensorBoard events, and for fit
checkpoints/last.ckpt); predict logs nothing unless given --trainer.logger; a run that fails
before its first batch leaves no version_N/ behind.
A configuration error prints what is wrong and, last, a `fix:` line naming the flags to
change (exit status 2); {DEBUG_ENV}=1 shows its traceback instead.  When stdout is not
a terminal, a line every few epochs replaces the progress bar (unless
--trainer.enable_progress_bar is given).

examples:
  {prog} fit
  {prog} test --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt
  {prog} fit --config examples/configs/community_sage.yaml --trainer.max_epochs=50
  {prog} fit --data.data=Cora --data.root=../shared/datasets/Planetoid --model.conv=gat
  {prog} partition --data community --num-parts 4
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-fullgraph`` and ``python -m lightning_fullgraph``.

    Args:
        argv: Arguments without the program name (``None``: ``sys.argv[1:]``).  Note that
            the default ``popen`` launcher starts the other ranks by re-running
            ``sys.argv``, so multi-process runs must come from the command line.

    Returns:
        The exit status: 0, or 2 after a configuration error (:class:`ConfigurationError`:
        what is wrong, then a last line saying which flags to change; with
        :data:`DEBUG_ENV` ``=1`` it is raised, traceback and all).  ``partition``'s parsing
        errors exit through ``SystemExit``.
    """
    import lightning_fullgraph  # noqa: F401  (registers the fullgraph_* strategy names)

    # Lightning 2.6.6 on torch >= 2.13 warns about a torch-internal rename on every step
    # (outside the strategy's setup..teardown too: the CLI's own loops); for this call only.
    leafspec = leafspec_filter()
    leafspec.install()
    try:
        return _main(argv)
    finally:
        leafspec.remove()


def _main(argv: list[str] | None) -> int:
    import lightning_fullgraph

    args = list(sys.argv[1:] if argv is None else argv)
    prog = _invoked_as()
    if args and args[0] == "partition":
        return partition_main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(_help(prog))
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {lightning_fullgraph.__version__}")
        return 0
    try:
        # Give LightningCLI `args=None` when reading sys.argv, so it does not warn about both.
        FullGraphCLI(args=None if argv is None else args, parser_kwargs=_parser_kwargs(prog))
    except ConfigurationError as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        subcommand = next((a for a in args if a in FullGraphCLI.subcommands()), None)
        sys.stdout.flush()  # what was printed before comes first
        sys.stderr.write(f"{prog}{' ' + subcommand if subcommand else ''}: {err.problem}\nfix: {err.fix}\n")
        sys.stderr.flush()
        return 2
    return 0
