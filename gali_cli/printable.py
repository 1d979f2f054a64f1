"""Strings from strangers (a request's path, a document's label, a file name) made safe to show on a terminal or in a
log: every control, format or separator character and lone surrogate written as its escape, so that `%0A` cannot
forge a log line, `ESC [2J` cannot clear the operator's screen and U+202E cannot reverse what they read. And made
writable as UTF-8 (a file, a JSON line, safetensors metadata) when a file name holds bytes that are not UTF-8, which
Python keeps as lone surrogates (b"\\xff" is "\\udcff"); and JSON (--json, results files) with them escaped."""

import json
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


def some_names(paths: list, shown: int = 3) -> str:
    """"a, b, c and 4 more": the first `shown` of `paths`' file names, printable (they are strangers' too)."""
    names = ", ".join(printable(path.name) for path in paths[:shown])
    return names + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def encodable(text: str) -> str:
    """`text` with each lone surrogate as its escape (\\udcff), the only characters UTF-8 cannot encode; a file name
    with a byte that is not UTF-8 would otherwise fail every write of it (UnicodeEncodeError)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_text(value: object) -> str:
    """`value` as JSON, other scripts as themselves and every unsafe character (as printable() finds them: C1
    controls such as the 8-bit CSI U+009B, bidi overrides, lone surrogates) as its \\u escape, wherever the JSON
    goes: shown on a terminal, it cannot move the cursor or reverse text, and a pipe or a file (often shown on a
    terminal later) gets the same valid UTF-8 JSON, from which json.loads gives the very same strings back (each
    such character only ever stands inside a JSON string, where \\u202e is its escape)."""
    text = json.dumps(value, ensure_ascii=False)
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(_json_escape(character) if unicodedata.category(character) in _UNSAFE else character
                   for character in text)


def _json_escape(character: str) -> str:
    code = ord(character)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # JSON writes a character past U+FFFF as its UTF-16 surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
