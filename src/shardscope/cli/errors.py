"""The CLI's error type: one line for the user and an exit code."""

from __future__ import annotations

import argparse
from typing import NoReturn


class CliError(Exception):
    """Bad input or an impossible request: printed as one line, exit code 2 unless stated."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
