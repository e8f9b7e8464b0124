"""Bounded reading and parsing of every data file a user hands over: profiles, models, config.json, plans, telemetry.

A data file is parsed, never run, and what it can cost is bounded before it is built: its size (read at most one
byte past the limit, from a regular file only: a FIFO or /dev/zero is refused, not read), its nesting depth and
its expanded size (YAML aliases share nodes, so a 1.5 KB file can stand for a billion of them: the count is of
the tree as it would be walked, each alias counted as what it names).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import stat
from pathlib import Path

import yaml

from .errors import UserInputError

MAX_DEPTH = 64            # the deepest real input (a plan: stages -> records -> lists) is 5 levels
MAX_NODES = 1_000_000     # a plan of 16,384 devices and 1,000 stages holds about 50,000 values
# texts up to this size are parsed once per process: the same profile is read for every plan a search, a sweep or
# a calibration weighs, and the pure-Python loader the bounds need takes about 10 ms a profile
CACHED_TEXT_CHARS = 1 << 16


def read_bounded_text(path: str | Path, what: str, limit_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most `limit_bytes`; anything else one paragraph naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO opens without waiting for a writer
    except FileNotFoundError:
        raise UserInputError("file not found", source=str(path), expected=f"a readable {what}") from None
    except OSError as exc:
        raise UserInputError(f"cannot open ({exc.strerror})", source=str(path), expected=f"a readable {what}") \
            from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a special file (FIFO, device or socket)"
        raise UserInputError(f"{kind}, not a file", source=str(path), expected=f"a {what}")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise UserInputError(f"over {limit_bytes:,} bytes", source=str(path),
                             expected=f"a {what} under {_size_words(limit_bytes)}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserInputError(f"not UTF-8 text (byte {exc.start})", source=str(path), expected=f"a UTF-8 {what}") \
            from None


def _size_words(limit_bytes: int) -> str:
    return f"{limit_bytes >> 20} MB" if limit_bytes >= 1 << 20 else f"{limit_bytes >> 10} KB"


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a tree deeper than MAX_DEPTH or larger than MAX_NODES once expanded."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0
        self.expanded: dict[int, int] = {}   # id(node) -> nodes under it, its aliases expanded

    def compose_node(self, parent, index):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _TooLarge(f"nested deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        self.expanded[id(node)] = 1 + sum(self.expanded.get(id(child), 1) for child in _children(node))
        if self.expanded[id(node)] > MAX_NODES:
            raise _TooLarge(f"more than {MAX_NODES:,} values once its aliases are expanded")
        return node


def _children(node):
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return ()


class _TooLarge(Exception):
    pass


def parse_yaml(text: str, source: str):
    """The data of a YAML text, its depth and expanded size bounded; a copy of its own for each caller (a small
    text's parse is kept by its content, so a file rewritten between reads is parsed again)."""
    try:
        if len(text) <= CACHED_TEXT_CHARS:
            return copy.deepcopy(_parsed(text))
        return _load(text)
    except _TooLarge as exc:
        raise UserInputError(f"the YAML is {exc}", source=source, expected="a profile, model or plan file") \
            from None
    except RecursionError:
        raise UserInputError(f"the YAML is nested deeper than {MAX_DEPTH} levels", source=source) from None
    except yaml.YAMLError as exc:
        raise UserInputError(f"not valid YAML ({str(exc).splitlines()[0]})", source=source) from None


def _load(text: str):
    return yaml.load(text, Loader=_BoundedLoader)   # noqa: S506 - a SafeLoader subclass


@functools.lru_cache(maxsize=128)
def _parsed(text: str):
    """A small text's data, parsed once (a refusal raises every time: exceptions are not kept)."""
    return _load(text)


def parse_json(text: str, source: str):
    """The data of a JSON text, its depth bounded (the text's size bounds its node count)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise UserInputError(f"the JSON is nested deeper than {MAX_DEPTH} levels", source=source) from None
    except json.JSONDecodeError as exc:
        raise UserInputError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                             source=source) from None
    if _depth(data) > MAX_DEPTH:
        raise UserInputError(f"the JSON is nested deeper than {MAX_DEPTH} levels", source=source)
    return data


def _depth(data) -> int:
    """The nesting depth of parsed JSON, walked without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest
