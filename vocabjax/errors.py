"""The one exception type for mistakes a user can fix (bad sizes, missing files, corrupt profiles).

The command line turns it into a single ``Error: ...`` line and exit code 1; library callers can
catch it like any ``ValueError``.

A message that tells the user which setting to change names it as ``{name}``, with ``name`` in
``settings``: the library's own name for it (a ``RunConfig`` field, a keyword argument, corpus
fields as ``corpus.field``). ``str`` shows that name; a front end shows its own spelling with
:meth:`UserError.render` (the command line: the flag that sets it), so the library never names
a flag and the command line never names a field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

_SETTING = re.compile(r"\{([\w.]+)\}")


class UserError(ValueError):
    """A problem with the user's input, stated in one line."""

    def __init__(self, message: str, *, settings: Iterable[str] = ()) -> None:
        self.template = message
        self.settings = tuple(settings)
        super().__init__(self.render(lambda name: name))

    def render(self, spell: Callable[[str], str]) -> str:
        """The message with each named setting spelled by ``spell`` (name -> text)."""
        if not self.settings:
            return self.template
        return _SETTING.sub(lambda m: spell(m[1]) if m[1] in self.settings else m[0], self.template)
