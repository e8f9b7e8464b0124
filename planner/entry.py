"""The `planner` command's entry point: Ctrl-C ends it with status 130 and the one line `interrupted`, from
its first instant.

The CLI's imports (torch, OR-Tools, transformers) take seconds, and a Ctrl-C inside them does not always
arrive as a KeyboardInterrupt: an extension's initialisation turns it into `ImportError: initialization
failed`, and a library that imports an optional dependency under `except ImportError` swallows it, after
which the search ran to the end and printed a plan (exit 0). So the signal is recorded here, before any
heavy import, and a recorded one ends the command whatever became of the exception.
"""
from __future__ import annotations

import signal
import sys

INTERRUPTED = 128 + signal.SIGINT   # the shell's status for a process ended by SIGINT


class InterruptRecorder:
    """A SIGINT handler that raises KeyboardInterrupt, as Python's own does, and remembers that it did."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def raise_if_seen(self) -> None:
        """Called where the command can stop cleanly (between search steps): an interrupt a library
        swallowed is raised again there."""
        if self.seen:
            raise KeyboardInterrupt


def recorded_interrupts() -> InterruptRecorder | None:
    """The recorder this process's entry point installed (None when the CLI runs inside another program)."""
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, InterruptRecorder) else None


def _interrupted() -> None:
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(INTERRUPTED)


def main() -> None:
    if sys.argv[1:] == ["--version"]:   # without the CLI's imports (torch, OR-Tools: seconds)
        from importlib.metadata import version
        print(f"parallel-planner {version('parallel-planner')}")
        sys.exit(0)
    recorder = InterruptRecorder()
    signal.signal(signal.SIGINT, recorder)
    try:
        from planner.cli import main as cli_main
    except BaseException:   # an interrupt inside an import may surface as any exception, or as none
        if recorder.seen:
            _interrupted()
        raise
    if recorder.seen:
        _interrupted()
    try:
        cli_main()
        status = 0
    except SystemExit as done:
        status = done.code
    # the command is done: a Ctrl-C from here on would land in the interpreter's teardown, which restores the
    # default handler and ends the process by the signal (status -2) after its output is complete
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if recorder.seen and status != INTERRUPTED:   # swallowed somewhere after the imports, and the command ran on
        _interrupted()
    sys.exit(status)
