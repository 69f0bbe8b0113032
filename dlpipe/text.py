"""What a command prints of user and dataset text: terminal control characters escaped.

Text that came from a user or a dataset (paths, class, split and field names, error messages) is
printed with no terminal control character in it (`printable`: an ESC that would clear the
screen or retitle the window, a CR or backspace that would overwrite an earlier line, a bidi
override that would reorder it are shown as ``\\x1b``, ``\\u202e``...) and never read as rich
markup (`shown`). What dlpipe writes to files (the manifest, ``errors.jsonl``) keeps the names as
they are: they are data. `Interrupted` carries the one line a Ctrl-C prints. Core: every room
prints through these, and none imports the CLI.
"""

from __future__ import annotations

import unicodedata

from rich.markup import escape

__all__ = ["Interrupted", "printable", "shown"]

_JOINERS = frozenset("\u200c\u200d")  # format characters that emoji and scripts need
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _is_control(char: str) -> bool:
    """C0/C1 controls and DEL (Cc), lone surrogates (Cs), line and paragraph separators and
    invisible format characters such as the bidi overrides (Cf, but the joiners)."""
    kind = unicodedata.category(char)
    return kind in ("Cc", "Cs", "Zl", "Zp") or (kind == "Cf" and char not in _JOINERS)


def _escaped(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape): as display_path
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str, *, keep: str = "") -> str:
    """`text` with every terminal control character escaped as Python writes it (``\\x1b``,
    ``\\x9b``, ``\\u202e``; a byte that was not UTF-8 as ``\\xNN``), for printing names that
    came from a user or a dataset. Characters in `keep` (``"\\n"`` for a block of lines) stay;
    backslashes are not escaped, so text escaped once prints the same escaped again."""
    if text.isprintable():
        return text
    return "".join(_escaped(c) if c not in keep and _is_control(c) else c for c in text)


def shown(value: object) -> str:
    """User or dataset text for a rich markup string: `printable`, and never read as markup."""
    return escape(printable(str(value)))


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C a handler caught to say how to finish the work (``args[0]`` is the line)."""
