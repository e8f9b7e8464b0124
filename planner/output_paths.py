"""Where the CLI writes: checked before any work, never through a symbolic link, never a surprise.

A plan is written to a file and a what-if report into a directory; each is refused, with the reason,
before the search starts when the path cannot be that (a directory where a file is meant, or the
reverse), is a symbolic link (give the path it points to if overwriting that is meant), or cannot be
written.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from hardware_profiles.errors import UserInputError

PLAN_SUFFIXES = (".yaml", ".yml", ".json")


def _writable_ancestor(path: Path, flag: str) -> None:
    ancestor = path.parent
    while not os.path.exists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserInputError(f"cannot write under {ancestor}", field=flag,
                             expected="a path in a directory you can write")


def _refuse_link(path: Path, flag: str) -> None:
    if os.path.islink(path):
        raise UserInputError(f"{path} is a symbolic link", field=flag,
                             expected="the path it points to, if overwriting that is what you mean")


def check_plan_file(text: str, flag: str = "--out") -> Path:
    """A file the plan can be written to: .yaml/.yml/.json, not a directory, not a link, writable."""
    path = Path(text)
    if text.endswith(("/", os.sep)) or os.path.isdir(path):
        raise UserInputError(f"{text} is a directory", field=flag,
                             expected="a file name ending in .yaml or .json (the plan is one file)")
    if path.suffix not in PLAN_SUFFIXES:
        raise UserInputError(f"{text} has no plan suffix", field=flag, expected="a name ending in .yaml or .json")
    _refuse_link(path, flag)
    _refuse_special(path, flag)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UserInputError(f"{path} is not writable", field=flag, expected="a file you can write")
    _writable_ancestor(path, flag)
    return path


def _refuse_special(path: Path, flag: str) -> None:
    """A FIFO, device or socket is never written as a file (opening a FIFO waits for a reader: a hang)."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise UserInputError(f"{path} is a special file (FIFO, device or socket)", field=flag,
                             expected="a regular file or a new name")


def check_report_dir(text: str, flag: str = "--out") -> Path:
    """A directory the what-if report can be written into: an existing directory or a new one."""
    path = Path(text)
    _refuse_link(path, flag)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"{text} is a file", field=flag,
                             expected="a directory (the report is whatif.png and whatif.html inside it)")
    if os.path.isdir(path):
        for name in ("whatif.png", "whatif.html"):
            _refuse_link(path / name, flag)
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserInputError(f"{path} is not writable", field=flag, expected="a directory you can write")
    else:
        _writable_ancestor(path, flag)
    return path


def write_no_follow(path: Path, data: bytes) -> None:
    """Write a file without following a symbolic link put there after the check (O_NOFOLLOW)."""
    # O_NONBLOCK: a FIFO put there after the check fails to open instead of waiting for a reader
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as exc:
        raise UserInputError(f"cannot write {path} ({exc.strerror})", field="--out",
                             expected="a writable file that is not a symbolic link") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UserInputError(f"{path} is a special file (FIFO, device or socket)", field="--out",
                             expected="a regular file or a new name")
    os.set_blocking(descriptor, True)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
