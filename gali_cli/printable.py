"""Strings from strangers (a request's path, a document's label, a file name) made safe to show on a terminal or in a
log: every control, format or separator character and lone surrogate written as its escape, so that `%0A` cannot
forge a log line, `ESC [2J` cannot clear the operator's screen and U+202E cannot reverse what they read."""

import unicodedata

_UNSAFE = {"Cc", "Cf", "Cs", "Zl", "Zp"}  # controls, formats (bidi overrides), lone surrogates, line/para separators


def printable(text: str) -> str:
    """`text` with each unsafe character as Python writes it in a string literal (\\n, \\x1b, \\u202e, \\udcff);
    everything else, other scripts and emoji included, as it is. A backslash stays one backslash."""
    if text.isprintable():  # the common case, at C speed (isprintable is False for every unsafe category)
        return text
    return "".join(_escape(character) if unicodedata.category(character) in _UNSAFE else character
                   for character in text)


def _escape(character: str) -> str:
    code = ord(character)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if character in named:
        return named[character]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
