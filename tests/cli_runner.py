"""The CLI run in this process as a user runs it, and what every answer to bad input must be: exit 0 or 2,
never a traceback or another status, one paragraph naming the file or field, within CASE_LIMIT_S."""
import contextlib
import io
import sys
import time
from dataclasses import dataclass

from planner import cli

CASE_LIMIT_S = 10.0


@dataclass
class Outcome:
    code: int
    err: str
    seconds: float


def _rebind_transformers_logging() -> None:
    """transformers' log handler keeps the stderr of its first warning: under earlier tests' captures, a stream
    since closed, and a later warning prints a '--- Logging error ---' traceback. Dropped, it is made again on
    the next warning, on the stderr this run reads."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging._reset_library_root_logger()


def run_cli(args: list[str], capsys, monkeypatch) -> Outcome:
    _rebind_transformers_logging()
    monkeypatch.setattr(sys, "argv", ["planner", *args])
    capsys.readouterr()
    started = time.perf_counter()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return Outcome(code, capsys.readouterr().err, time.perf_counter() - started)


def run(args: list[str]) -> Outcome:
    """`run_cli` without pytest's fixtures (hypothesis runs many examples in one test)."""
    _rebind_transformers_logging()
    argv, stderr = sys.argv, io.StringIO()
    sys.argv = ["planner", *args]
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        sys.argv = argv
    return Outcome(code, stderr.getvalue(), time.perf_counter() - started)


def check(outcome: Outcome, case: str, valid: bool | None) -> None:
    assert outcome.seconds < CASE_LIMIT_S, f"{case}: {outcome.seconds:.1f} s"
    assert "Traceback" not in outcome.err, f"{case}: {outcome.err[-2000:]}"
    assert outcome.code in (0, 2), f"{case}: exit {outcome.code}: {outcome.err[-500:]}"
    if outcome.code == 2:
        first = outcome.err.strip()
        usage = "Usage:" in first or first.startswith(("Error:", "Try"))   # click's own option errors
        assert usage or (first.startswith("error: ") and ("field '" in first or ":" in first[7:])), \
            f"{case}: {first[:300]}"
        assert len(first) < 5000, f"{case}: message of {len(first)} characters"
    if valid is not None:
        assert outcome.code == (0 if valid else 2), f"{case}: exit {outcome.code}: {outcome.err[-500:]}"
