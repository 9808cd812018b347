"""The one error type a subcommand raises for the user: a line to print and an exit code.

The CLI catches it in one place, so library code never prints or exits and every
command fails the same way: ``fuse-device-plugin: error: <message>``, never a traceback.
"""

from __future__ import annotations

EXIT_FAILURE = 1  # a runtime failure
EXIT_USAGE = 2  # bad flags or input


class Failure(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code
