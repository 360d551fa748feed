"""The one error type for bad user input.

Raised by library code when an argument, file or model cannot be used; the CLI prints its
message on one line and exits with status 2. Its message says what is wrong and what to do.
"""


class UserError(ValueError):
    """Bad input from the user: a one-line message, no traceback needed."""
