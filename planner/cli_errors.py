"""click's usage errors (an unknown option or command, a missing or bad value) as the CLI's one paragraph: the
flag or word named, the closest real one suggested, and what was expected."""
from __future__ import annotations

import difflib
import sys

from hardware_profiles.errors import UserInputError


def error_kinds(exc: BaseException) -> set[str]:
    """The names of an exception's classes: click's, whether typer vendors it or not."""
    return {kind.__name__ for kind in type(exc).__mro__}


def usage_error(exc) -> UserInputError:
    """click's usage errors as the CLI's one paragraph: the flag named, the closest real one suggested."""
    command = exc.ctx.command if exc.ctx else None
    where = f"planner {exc.ctx.command_path.partition(' ')[2]}".strip() if exc.ctx else "planner"
    options = sorted({opt for param in getattr(command, "params", []) for opt in param.opts if opt.startswith("-")})
    kinds = error_kinds(exc)
    if "NoSuchOption" in kinds:
        near = difflib.get_close_matches(exc.option_name, options, n=1, cutoff=0.5)
        hint = f"{near[0]} (the closest option of {where})" if near else f"one of {', '.join(options)}"
        return UserInputError(f"{where} has no option {exc.option_name}", field=exc.option_name, expected=hint)
    if "MissingParameter" in kinds and exc.param is not None:
        name = exc.param.opts[0] if exc.param.opts else exc.param.name
        return UserInputError(f"{where} needs {name}", field=name, expected=exc.param.help or "a value")
    if "BadParameter" in kinds:
        name = exc.param.opts[0] if exc.param is not None and exc.param.opts else exc.param_hint
        return UserInputError(exc.format_message(), field=str(name) if name else None,
                              expected=(exc.param.help if exc.param is not None and exc.param.help else None)
                              or f"a value {where} --help describes")
    commands = sorted(getattr(command, "commands", {}) or {})
    if commands:   # a group: the word given is no command of it
        path = exc.ctx.command_path.split()[1:] if exc.ctx else []
        words = [word for word in sys.argv[1:] if not word.startswith("-")]
        given = words[len(path)] if len(words) > len(path) else ""
        near = difflib.get_close_matches(given, commands, n=1, cutoff=0.5)
        return UserInputError(f"{where} has no command '{given}'", field="command",
                              expected=f"{near[0]} (the closest)" if near else f"one of {', '.join(commands)}")
    return UserInputError(exc.format_message(), field=where, expected=f"what {where} --help describes")
