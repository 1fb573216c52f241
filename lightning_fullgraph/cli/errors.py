"""Configuration errors whose last line names the flags to change, and the readers that explain them.

:class:`ConfigurationError` is ``(problem, fix)``; the functions here turn jsonargparse's
messages, unknown strategy names and the package's own messages into that pair."""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import inspect
import re
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry


class ConfigurationError(ValueError):
    """A configuration error found by :class:`~lightning_fullgraph.cli.train.FullGraphCLI` before
    anything was trained.

    Its message is ``problem`` (what is wrong; an error raised by the package keeps its type
    and wording) followed by one line, ``fix: ...``, that says what to change as command-line
    flags.  The error it summarizes, if any, is its ``__cause__``.  ``main`` prints the two
    parts and exits with status 2 (the traceback with
    :data:`~lightning_fullgraph.cli.names.DEBUG_ENV` ``=1``).

    Args:
        problem: What is wrong (may span lines).
        fix: One line: what to change, as flags (``--data.num_parts``, not ``num_parts=``).
    """

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}\nfix: {fix}")
        self.problem = problem
        self.fix = fix

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.problem, self.fix)


def unknown_strategy(name: str, registered: Sequence[str] | None = None) -> tuple[str, str]:
    """``(problem, fix)`` for a strategy name that is not registered with Lightning: the fix
    suggests the nearest registered name (:func:`difflib.get_close_matches`).

    Args:
        name: The name given (``--trainer.strategy``).
        registered: The registered names (default: Lightning's ``StrategyRegistry``).
    """
    registered = list(StrategyRegistry.available_strategies() if registered is None else registered)
    ours = [n for n in registered if n.startswith("fullgraph_")]
    problem = (
        f"--trainer.strategy={name} is not a registered strategy name; this package registers "
        f"{', '.join(ours)} (Lightning's own include auto, ddp, ddp_spawn, ...), and a class path "
        "such as lightning_fullgraph.FullGraphStrategy is accepted too"
    )
    close = difflib.get_close_matches(name.lower(), ours, n=1, cutoff=0.6) or difflib.get_close_matches(
        name.lower(), registered, n=1, cutoff=0.6
    )
    if close:
        return problem, f"did you mean --trainer.strategy={close[0]}?"
    return problem, f"set --trainer.strategy to one of {', '.join(ours)} (or another registered name)"


#: Lines of jsonargparse's error messages that only give their structure.
_STRUCTURE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
)


def error_leaves(
    message: str,
) -> tuple[list[tuple[tuple[str, ...], str]], dict[tuple[str, ...], str], dict[tuple[str, ...], str]]:
    """Reads jsonargparse's nested error message.

    Returns:
        ``(leaves, values, class_paths)``: every line that says what is wrong, with the chain
        of ``Parser key`` names above it; the ``Given value`` of a chain; the class path a
        chain's ``Problem with given class_path`` names.
    """
    stack: list[tuple[int, str]] = []
    leaves: list[tuple[tuple[str, ...], str]] = []
    values: dict[tuple[str, ...], str] = {}
    class_paths: dict[tuple[str, ...], str] = {}
    for raw in message.splitlines():
        text = raw.lstrip(" ")
        if not text:
            continue
        indent = len(raw) - len(text)
        if text.startswith("- "):
            text, indent = text[2:], indent + 2
        while stack and stack[-1][0] >= indent:
            stack.pop()
        chain = tuple(key for _, key in stack)
        key = re.match(r'Parser key "([^"]+)":\s*(.*)$', text)
        if key:
            stack.append((indent, key.group(1)))
            if key.group(2):
                leaves.append(((*chain, key.group(1)), key.group(2)))
            continue
        problem = re.match(r"Problem with given class_path '([^']+)':\s*(.*)$", text)
        if problem:
            class_paths[chain] = problem.group(1)
            if problem.group(2):
                leaves.append((chain, problem.group(2)))
            continue
        if text.startswith("Given value:"):
            values.setdefault(chain, text.split(":", 1)[1].strip())
            continue
        if not text.startswith(_STRUCTURE):
            leaves.append((chain, text))
    return leaves, values, class_paths


_TYPE_WORDS = {"int": "an int", "float": "a number", "bool": "true or false", "str": "a string"}


def explain_parse_error(message: str) -> tuple[str, str]:
    """``(problem, fix)`` of a jsonargparse error message, both naming the flag (``--a.b``)
    of the innermost ``Parser key`` the message reports; ``fix`` is ``""`` if the message
    is not one of the known shapes."""
    leaves, values, class_paths = error_leaves(message)
    useful = [(c, t) for c, t in leaves if t != "Expected a <class 'NoneType'>"]
    if not useful:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments", ""
    depth = max(len(c) for c, _ in useful)
    deepest = [(c, t) for c, t in useful if len(c) == depth]
    informative = [(c, t) for c, t in deepest if t != "Expected a <class 'str'>"] or deepest
    chain, text = informative[0]
    flag = "--" + ".".join(chain) if chain else "the arguments"
    got = re.search(r"\. Got value: (.*)$", text)
    value = got.group(1) if got else values.get(chain)
    text = text[: got.start()] if got else text
    literal = re.match(r"Expected a typing\.Literal\[(.*)\]$", text)
    if literal:
        try:
            choices = [str(c) for c in ast.literal_eval(f"[{literal.group(1)}]")]
        except (SyntaxError, ValueError):
            choices = [literal.group(1)]
        return (
            f"{flag}={value}: not one of {', '.join(choices)}",
            f"set {flag} to one of: {', '.join(choices)}",
        )
    types = [m.group(1) for _, t in deepest if (m := re.match(r"Expected a <class '(\w+)'>$", t))]
    if types and text.startswith("Expected a <class"):
        words = [_TYPE_WORDS.get(t, f"a {t}") for t in types if t != "NoneType"]
        nullable = any(c == chain and t == "Expected a <class 'NoneType'>" for c, t in leaves)
        wanted = " or ".join(words + (["null"] if nullable else []))
        return f"{flag}={value}: expected {wanted}", f"set {flag} to {wanted}"
    dotted = re.match(r"Expected a dot import path string: (.*)$", text)
    if dotted:
        name = dotted.group(1).strip()
        example = "module.Class"
        registered = flag == "--trainer.strategy" and name.lower() in StrategyRegistry
        # (the registry's own `get` instantiates the strategy: read its entry)
        params = dict.get(StrategyRegistry, name.lower(), {}).get("init_params") or {} if registered else {}
        if params:
            settings = " ".join(f"{flag}.{k}={v}" for k, v in params.items())
            example = f"lightning_fullgraph.FullGraphStrategy {settings}"
        return (
            f"{flag}={name} is a name: it takes no {flag}.* settings, a class path does",
            f"give {flag}={example} with the {flag}.* settings, or drop them",
        )
    option = re.match(r"Option '([^']+)' is not accepted", text)
    if option:
        name = option.group(1)
        class_path = class_paths.get(chain, "")
        params: list[str] = []
        with contextlib.suppress(Exception):
            module, _, attr = class_path.rpartition(".")
            params = [p for p in inspect.signature(getattr(importlib.import_module(module), attr)).parameters]
        close = difflib.get_close_matches(name, params, n=1, cutoff=0.6)
        owner = class_path.rpartition(".")[2] or chain[-1]
        fix = f"remove {flag}.{name}" + (f" (did you mean {flag}.{close[0]}?)" if close else "")
        return f"{flag}.{name}: {owner} has no argument {name!r}", fix
    if class_paths.get(chain):
        return (
            f"{flag}.class_path={class_paths[chain]}: {text}",
            f"set {flag}.class_path to an importable class (module.Class): {text}",
        )
    return f"{flag}: {text}", f"correct {flag}: {text}"


#: Words a fix clause of the package's messages starts with.
_IMPERATIVES = (
    "add",
    "apply",
    "call",
    "choose",
    "convert",
    "drop",
    "give",
    "mark",
    "pass",
    "remove",
    "run",
    "set",
    "use",
)


def imperative_clause(message: str) -> str | None:
    """The last clause of the message's last line that says what to do, if any."""
    lines = message.strip().splitlines()
    if not lines:
        return None
    parts = re.split(r"[;:]\s+", lines[-1])
    for part in reversed(parts):
        if part.split(" ", 1)[0].lower() in _IMPERATIVES:
            return part.rstrip(".")
    return None


def as_flags(text: str, flags: dict[str, Any]) -> str:
    """``name=`` and `` `name` `` in ``text`` as ``--group.name=`` / ``--group.name`` where
    exactly one flag ends in ``.name``."""
    owners: dict[str, list[str]] = {}
    for flag in flags:
        owners.setdefault(flag.rsplit(".", 1)[-1].lstrip("-"), []).append(flag)
    for name, found in owners.items():
        if len(found) != 1 or not name.isidentifier():
            continue
        text = re.sub(rf"(?<![\w.\-`]){re.escape(name)}=", f"{found[0]}=", text)
        text = text.replace(f"`{name}`", found[0])
    # Python literals after a flag, as the command line spells them
    return re.sub(r"(--[\w.]+=)(True|False|None)\b", lambda m: m.group(1) + _CLI_LITERALS[m.group(2)], text)


_CLI_LITERALS = {"True": "true", "False": "false", "None": "null"}


def found_before_launch(err: BaseException) -> bool:
    """Whether the launcher's checks (:func:`lightning_fullgraph.launch.preflight.check_before_launch`),
    which run before any rank starts, raised ``err``."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lightning_fullgraph") and frame.f_code.co_name in (
            "_preflight",
            "check_before_launch",
        ):
            return True
        tb = tb.tb_next
    return False
