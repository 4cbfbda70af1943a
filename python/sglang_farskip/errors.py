"""Bad user input, the same way in every command: one `error: ...` line on stderr, exit code 2.

Pure Python (no torch, no SGLang): config.py, the planner and the bare GPU check import it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

EXIT_USER_ERROR = 2  # argparse's own code for bad flags: one code for every bad input


class UserError(ValueError):
    """Input the user must change: a flag, a checkpoint, a config.json key, a data file.

    The message names the problem and the fix, and is printed as one `error:` line with exit
    code 2 (`fail`). A ValueError, as two of the classes it replaced were: SGLang code that
    catches ValueError around our hooks keeps handling it as before."""


def fail(message: object) -> int:
    """Print the one `error:` line; the exit code a command returns for it."""
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def run_main(main: Callable[..., int], *args) -> int:
    """`main(*args)`, with a UserError turned into its `error:` line and exit code 2."""
    try:
        return main(*args)
    except UserError as e:
        return fail(e)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with one `error:` line (and exit 2) instead of its usage block."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message}: see `{self.prog} --help`\n")
