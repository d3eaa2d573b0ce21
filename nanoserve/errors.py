"""The one exception a user of nanoserve is meant to see.

`NanoserveError` carries a sentence that says what went wrong and what to do about it. The CLI
prints it on one line and exits non-zero; the server turns it into a 4xx error object. Anything
else that escapes is a bug in nanoserve, not a mistake of the user's.
"""


class NanoserveError(Exception):
    """A problem the user can fix: a bad path, a bad option, an input that does not fit."""


class GateError(AssertionError):
    """A gate (`check_<fact>`) found its fact false: the message names the fact and the values."""
