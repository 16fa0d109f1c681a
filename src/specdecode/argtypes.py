"""argparse types shared by every `specdecode` command (cli.py, bench/cli.py, check/cli.py).

Each converts one flag's text or raises argparse.ArgumentTypeError saying what is wrong;
argparse names the flag, and the CLI prints one line and exits 2 (cli.py's Parser).
Numbers are finite: every number type below refuses "nan" and "inf".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

PORTS = (0, 65535)  # 0: any free port


def integer(text: str) -> int:
    """An integer flag's value (the message says what is wrong, not the converter's name)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def number(text: str) -> float:
    """A number flag's value (nan and inf included: each type below bounds it)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _bounded(convert: Callable[[str], float], ok: Callable[[float], bool], what: str):
    """A type: `convert`, then refuse values for which `ok` is false ("must be WHAT")."""
    def parse(text: str):
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


non_negative_int = _bounded(integer, lambda v: v >= 0, ">= 0")
positive_int = _bounded(integer, lambda v: v >= 1, ">= 1")
finite = _bounded(number, math.isfinite, "a finite number")
positive_float = _bounded(number, lambda v: 0 < v < math.inf, "a finite number > 0")
non_negative_float = _bounded(number, lambda v: 0 <= v < math.inf, "a finite number >= 0")
seed = _bounded(integer, lambda v: 0 <= v < 2**64, "in 0..2**64-1")
probability = _bounded(number, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")  # nan: no
top_p = _bounded(number, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")  # nucleus mass
port = _bounded(integer, lambda v: PORTS[0] <= v <= PORTS[1], f"a port in {PORTS[0]}..{PORTS[1]}")


def number_list(convert: Callable[[str], float], minimum: float, example: str):
    """A type: comma-separated values of `convert` (integer or finite), each >= minimum."""
    kind = "integers" if convert is integer else "finite numbers"

    def parse(text: str) -> list:
        try:
            values = [convert(v) for v in text.split(",") if v.strip()]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected {kind} like {example}, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind} >= {minimum}, got {text!r}")
        return values
    return parse


def choice_list(choices: tuple[str, ...]):
    """A type: comma-separated names, each one of `choices`."""
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"unknown value '{bad[0] if bad else text}'; choose from {', '.join(choices)}")
        return values
    return parse


int_list = number_list(integer, 1, "4,8")
float_list = number_list(finite, 0, "0,0.7")
