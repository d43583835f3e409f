"""Errors a user can fix by changing a setting or a file: entry points print them as one line."""

from __future__ import annotations


class UserFacingError(ValueError):
    """The message names what is wrong (key, value or file), what is allowed, and what to do."""
