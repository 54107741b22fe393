"""Help that teaches: one example invocation under every subcommand's ``--help``, and the overview that
``lowbit`` without arguments prints (docs/cli.md, "Help").
"""

from __future__ import annotations

import argparse
from typing import Iterator

# The example shown by `PROG --help`, by the subcommand's prog. `lowbit bench OP` takes BENCH_EXAMPLE.
EXAMPLES = {
    "lowbit info": "lowbit info --backend auto",
    "lowbit smoke": "lowbit smoke all --backend auto",
    "lowbit bench": "lowbit bench hifloat8 --repeats 3 --plot bench.png",
    "lowbit bench all": "lowbit bench all --repeats 3 --json > bench.json",
    "lowbit wqbmm": "lowbit wqbmm example --dir /tmp/wqbmm --m 4 --n 256 --k 256",
    "lowbit wqbmm gen-data": "lowbit wqbmm gen-data --dir /tmp/wqbmm --m 4 --n 256 --k 256",
    "lowbit wqbmm run": "lowbit wqbmm run --dir /tmp/wqbmm --template preload",
    "lowbit wqbmm profile": "lowbit wqbmm profile --dir /tmp/wqbmm --backends native,reference",
    "lowbit wqbmm example": "lowbit wqbmm example --dir /tmp/wqbmm --m 4 --n 256 --k 256",
    "lowbit verify": "lowbit verify /tmp/wqbmm/output/output_z.bin /tmp/wqbmm/output/golden.bin",
    "lowbit eval": "lowbit eval --model minilm --schemes hif8-wo,mxfp4-wo --sentences 64 --plot eval.png",
    "lowbit quantize": "lowbit quantize --model minilm --scheme hif8-wo --out /tmp/minilm-hif8",
    "lowbit quantize-checkpoint": "lowbit quantize-checkpoint ./llm ./llm-mxfp4 --scheme mxfp4-wo --workers 2",
}
BENCH_EXAMPLE = "lowbit bench {op} --repeats 3 --plot bench.png"


def subcommand_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below ``parser`` (subcommands and their subcommands), depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield child
                yield from subcommand_parsers(child)


def example_for(prog: str) -> str:
    """The example invocation of subcommand ``prog`` ('lowbit wqbmm run'); KeyError if it has none."""
    words = prog.split()
    if prog not in EXAMPLES and words[:2] == ["lowbit", "bench"] and len(words) == 3:
        return BENCH_EXAMPLE.format(op=words[2])
    return EXAMPLES[prog]


def add_examples(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand of ``parser`` an 'example:' epilog (kept as written: raw formatting)."""
    for child in subcommand_parsers(parser):
        child.epilog = f"example:\n  {example_for(child.prog)}"
        child.formatter_class = argparse.RawDescriptionHelpFormatter


def overview(parser: argparse.ArgumentParser) -> str:
    """What ``lowbit`` without arguments prints: the description and one line per command."""
    lines = [f"{parser.prog}: {parser.description}", "", "commands:"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            width = max(len(choice.dest) for choice in action._choices_actions)
            lines += [f"  {choice.dest.ljust(width)}  {choice.help}" for choice in action._choices_actions]
    lines += ["", f"`{parser.prog} COMMAND --help` for its options and an example; "
                  f"start with `{parser.prog} smoke all`."]
    return "\n".join(lines)
