"""How every `kvrelay` command fails: `CommandError` and the exit codes (docs/operations.md)."""

from __future__ import annotations

from kvrelay.core.config import redact_url  # noqa: F401  (re-exported: commands import it here)
from kvrelay.core.errors import KvrelayError

# Exit codes of the CLI contract (docs/operations.md, "Exit codes").
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_UNAVAILABLE = EXIT_FAILURE  # Redis or the store node down or not answering


class CommandError(KvrelayError):
    """A failure reported as one line `kvrelay <cmd>: error: <message>` on stderr."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code
