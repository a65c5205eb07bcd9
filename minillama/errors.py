"""The one exception type users see.

Every failure caused by bad input (a config that breaks an invariant, an unknown backend, a corrupt
checkpoint, a prompt longer than the context, ...) raises :class:`MinillamaError` with a one-line
message. The CLI prints that line and exits with status 2 instead of showing a traceback.
"""


class MinillamaError(ValueError):
    """A user-facing error whose message is one clear line."""
