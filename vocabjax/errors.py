"""The one exception type for mistakes a user can fix (bad sizes, missing files, corrupt profiles).

The command line turns it into a single ``Error: ...`` line and exit code 1; library callers can
catch it like any ``ValueError``.
"""


class UserError(ValueError):
    """A problem with the user's input, stated in one line."""
