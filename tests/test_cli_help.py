"""Help that teaches: every subcommand's --help shows an example that parses; the overview lists commands."""

import shlex

import pytest

import lowbit

from lowbit.cli import help as cli_help
from lowbit.cli import main as cli
from lowbit.cli.main import build_parser


def parser_with_examples():
    parser = build_parser()
    cli_help.add_examples(parser)
    return parser


def test_every_subcommand_has_an_example_that_parses():
    parser = parser_with_examples()
    children = list(cli_help.subcommand_parsers(parser))
    assert {"lowbit smoke", "lowbit bench hifloat8", "lowbit wqbmm run", "lowbit verify"} <= {c.prog for c in children}
    for child in children:
        example = cli_help.example_for(child.prog)
        assert child.format_help().rstrip().endswith(f"example:\n  {example}")
        words = shlex.split(example.split(">")[0])
        assert words[0] == "lowbit" and " ".join(words[1:]).startswith(child.prog.split(" ", 1)[1])
        parser.parse_args(words[1:])  # raises (SystemExit or the parser's usage error) if it does not parse


def test_a_subcommand_without_an_example_is_refused():
    with pytest.raises(KeyError):
        cli_help.example_for("lowbit no-such-command")


def test_overview_lists_every_command_once_with_its_help():
    parser = build_parser()
    text = cli_help.overview(parser)
    commands = [line.split()[0] for line in text.splitlines() if line.startswith("  ")]
    assert commands[:3] == ["info", "smoke", "bench"] and "verify" in commands and "eval" in commands
    assert len(commands) == len(set(commands))
    assert "  smoke  " in text and "lowbit COMMAND --help" in text


def test_version_prints_lowbits_version(capsys):
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out == f"lowbit {lowbit.__version__}\n"
