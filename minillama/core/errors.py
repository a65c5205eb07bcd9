"""The one exception type users see.

Every failure caused by bad input (a config that breaks an invariant, an unknown backend, a corrupt
checkpoint, a prompt longer than the context, ...) raises :class:`MinillamaError` with a one-line
message. The CLI prints that line and exits with status 2 instead of showing a traceback.
"""


class MinillamaError(ValueError):
    """A user-facing error whose message is one clear line."""


class OutputError(MinillamaError, OSError):
    """Writing an output failed (a full disk, no permission, a folder where a file should go).

    Also an :class:`OSError`, so code that handles I/O failures keeps working; the file that was
    there before is left untouched (writes are atomic)."""
