"""The flags the benchmarks share, each shape written once: a benchmark's parser, the
sizes it runs, its repetitions, rounds and torch threads, and its dataset folder."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

Number = TypeVar("Number", int, float)


def positive(kind: type[Number]) -> Callable[[str], Number]:
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            value = kind(0)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive number")
        return value

    return parse


def positive_list(kind: type[Number]) -> Callable[[str], list[Number]]:
    """An argparse type: comma-separated numbers of `kind` above zero, e.g. 1,10,100."""
    one = positive(kind)

    def parse(text: str) -> list[Number]:
        items = [item for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected numbers like 1,10,100")
        return [one(item) for item in items]

    return parse


def bench_parser(
    what: str, description: str | None, preformatted: bool = False
) -> argparse.ArgumentParser:
    """The parser of `meshfl bench WHAT`; `preformatted`: the description (a module
    docstring) keeps its own lines."""
    return argparse.ArgumentParser(
        prog=f"meshfl bench {what}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter
        if preformatted
        else argparse.HelpFormatter,
    )


def add_sizes(
    parser: argparse.ArgumentParser, kind: type[Number], default: list[Number], what: str
) -> None:
    """--sizes: the sizes to run, `what` they are (e.g. "node counts")."""
    shown = ",".join(f"{size:g}" for size in default)
    parser.add_argument(
        "--sizes",
        type=positive_list(kind),
        default=default,
        help=f"{what}, comma-separated (default: {shown})",
    )


def add_repeats(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """--repeats: timed repetitions of each measurement."""
    parser.add_argument("--repeats", type=positive(int), default=default, help=help)


def add_rounds(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """--rounds: the rounds of each run."""
    parser.add_argument("--rounds", type=positive(int), default=default, help=help)


def add_threads(parser: argparse.ArgumentParser) -> None:
    """--threads: torch threads of the one process a benchmark measures in."""
    parser.add_argument("--threads", type=positive(int), default=1, help="torch threads")


def add_data_root(parser: argparse.ArgumentParser, help: str) -> None:
    """--data-root: the dataset folder, as for `meshfl launch`."""
    parser.add_argument("--data-root", metavar="DIR", help=help)
