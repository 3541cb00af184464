"""The ``daf`` command's argument parser: no abbreviations, and an unknown flag names the closest known one.

argparse by default takes ``--bit`` for ``--bits`` (a prefix), so a typo such as ``--batc`` could run with
another flag's value, and it reports an unknown flag only as "unrecognized arguments: --btis 2". ``Parser``
turns prefixes off (``allow_abbrev=False``, inherited by every subcommand's parser) and reports
``unrecognized argument --btis; did you mean --bits?`` from the subcommand that was given it.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any

__all__ = ["Parser", "closest_flag"]


def closest_flag(flag: str, known: Sequence[str]) -> str | None:
    """The known option string closest to ``flag`` (its part before any ``=``), or None when none is close.

    >>> closest_flag("--btis", ["--bits", "--batch", "--steps"])
    '--bits'
    >>> closest_flag("--zzzz", ["--bits"]) is None
    True
    """
    matches = difflib.get_close_matches(flag.partition("=")[0], list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and errors that name the closest flag.
    Subcommands made with ``add_subparsers().add_parser`` are ``Parser``s too (argparse uses the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen_chain(parsed)
            known = [flag for parser in chosen for flag in parser._option_string_actions]
            chosen[-1].error(_unrecognized(extras, known))
        return parsed

    def _chosen_chain(self, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
        """This parser and the subcommands' parsers ``parsed`` went through, outermost first: the flags any
        of them knows are valid where the unknown one stood."""
        chain: list[argparse.ArgumentParser] = [self]
        while True:
            actions = [a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)]
            name = getattr(parsed, actions[0].dest, None) if actions else None
            if name not in (actions[0].choices if actions else {}):
                return chain
            chain.append(actions[0].choices[name])


def _unrecognized(extras: list[str], known: list[str]) -> str:
    """The error for what no parser took: each unknown flag with the closest known one. A value after an
    unknown flag (the ``2`` of ``--btis 2``) is that flag's, so it is not listed."""
    flags = [extra for extra in extras if extra.startswith("-") and extra != "-"]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    parts = []
    for flag in flags:
        guess = closest_flag(flag, [k for k in known if k.startswith("--") or not flag.startswith("--")])
        parts.append(f"unrecognized argument {flag}" + (f"; did you mean {guess}?" if guess else ""))
    return "; ".join(parts)
