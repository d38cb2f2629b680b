"""The one exception type for mistakes a user can act on.

The CLI catches :class:`LmforgeError` and prints its message as a single line (no traceback), so
the message must name the file, key or value at fault and what was expected.
"""


class LmforgeError(Exception):
    """A user-facing error: bad input, bad configuration, missing file, invalid request."""
