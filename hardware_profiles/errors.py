"""One error type for bad user input, rendered as a single clear paragraph."""
from __future__ import annotations

import reprlib


QUOTE_LIMIT = 300   # characters of a user's value that a message repeats
_QUOTE = reprlib.Repr()   # a value's repr bounded as it is built: a billion-laughs YAML is never expanded
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 3, 8, 8, QUOTE_LIMIT, QUOTE_LIMIT


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """A value as messages quote it: a 1 MB flag is not echoed back whole."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class UserInputError(Exception):
    """Bad input from a user: a file, a field, a flag or a layout.

    The CLI prints `str(error)` and exits with status 2; it never shows a traceback.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 expected: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        self.expected = expected
        parts = []
        if source:
            parts.append(f"{clip(source)}:")
        if field:
            parts.append(f"field '{clip(field)}':")
        parts.append(clip(message, 4 * QUOTE_LIMIT).rstrip("."))
        text = " ".join(parts) + "."
        if expected:
            text += f" Expected {expected.rstrip('.')}."
        super().__init__(text)


def format_pydantic_error(source: str, exc, what: str = "profile") -> UserInputError:
    """Turn a pydantic ValidationError into one paragraph naming the file, what it is and the fields."""
    problems = []
    for err in exc.errors():
        location = ".".join(str(part) for part in err.get("loc", ())) or "(top level)"
        given = err.get("input")
        given_text = "" if isinstance(given, dict) else f" (got {clip(_QUOTE.repr(given))})"   # bounded before built
        problems.append(f"field '{location}': {err.get('msg', 'invalid')}{given_text}")
    first_field = ".".join(str(p) for p in exc.errors()[0].get("loc", ())) if exc.errors() else None
    message = "; ".join(problems)
    error = UserInputError(f"invalid {what}: {message}", source=source)
    error.field = first_field
    return error
