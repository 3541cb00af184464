"""``daf``'s parser (``daf.cli.arguments``): no abbreviations anywhere, and an unknown flag names the closest."""

import argparse

import pytest

from daf.cli import build_parser, main


@pytest.mark.parametrize("argv, message", [
    (["train", "tiny-mnist", "--btis", "2"], "daf train: error: unrecognized argument --btis; did you mean --bits?\n"),
    (["train", "tiny-mnist", "--bit", "2"], "unrecognized argument --bit; did you mean --bits?\n"),  # no prefix match
    (["train", "tiny-mnist", "--btis=2"], "unrecognized argument --btis=2; did you mean --bits?\n"),
    (["compare", "tiny-mnist", "--stpes", "3"], "daf compare: error: unrecognized argument --stpes; did you mean --steps?"),
    (["bench", "memory", "--quik"], "daf bench memory: error: unrecognized argument --quik; did you mean --quick?"),
    (["train", "tiny-mnist", "--zzzzzz"], "unrecognized argument --zzzzzz\n"),
    (["train", "tiny-mnist", "extra"], "unrecognized arguments: extra\n"),
])
def test_unknown_arguments_name_the_closest_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _parsers(child)
    return found


def test_no_parser_takes_abbreviations():
    parsers = _parsers(build_parser())
    assert len(parsers) > 6  # daf, workloads, train, compare, seeds, run, bench, bench memory, bench overhead
    assert [p.prog for p in parsers if p.allow_abbrev] == []
