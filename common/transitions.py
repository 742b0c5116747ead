"""The one error for a state change a transition table forbids (supervisor states, inbox stages)."""

from __future__ import annotations


class IllegalTransition(RuntimeError):
    """A transition the table does not allow: a programming error, never swallowed."""
