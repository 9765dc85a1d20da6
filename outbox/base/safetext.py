"""Stored strings shown on an operator's terminal cannot drive the terminal.

Notes, operator names, error messages, receiver request IDs and response bodies come
from people and from receivers. A string holding ESC, CSI or OSC sequences (C0 and C1
control characters) could clear the next operator's screen, rewrite what it shows, set
the window title or plant a hyperlink. Operator input with them is refused
(:func:`check_printable`); everything shown on a terminal is neutralised
(:func:`neutralise`, applied by the command line's console to every string it renders):
each control character becomes its visible ``\\xNN`` spelling.
Tabs and newlines are kept.
"""

from __future__ import annotations

import re

from outbox.errors import ValidationError

#: C0 controls except tab and newline, DEL, and the C1 controls (CSI is U+009B, OSC U+009D).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def neutralise(text: str) -> str:
    """``text`` with every terminal control character spelled out as ``\\xNN``."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def check_printable(text: str, what: str) -> str:
    """Refuse ``text`` if it holds a terminal control character (tab and newline allowed)."""
    found = _UNSAFE.search(text)
    if found:
        raise ValidationError(
            f"the {what} contains the control character \\x{ord(found.group()):02x} "
            f"at position {found.start()}; terminal escape sequences are not allowed"
        )
    return text
