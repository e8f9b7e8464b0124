"""Run every command the README shows and write (or check) the output it shows.

    python tools/readme_examples.py --write                  # regenerate README.md's example outputs
    python tools/readme_examples.py --check --bin VENV/bin   # CI: an installed package prints what README shows

Commands run with `bash` in a scratch directory outside the checkout (nothing of the repository on the path
but what `--bin` installs), at 100 columns. A ```console block holds `$ command` lines, each followed by its
output; `console lines=N` shows (and checks) the first N lines of each output. A ```python block is run and
must succeed. Commands in the task table's code spans run after the blocks and must succeed. What varies from
run to run is normalised before comparing: search times, losses (within 0.1%: CPUs differ), the scratch
directory; Python warnings are off and log lines of torch and of optional libraries left out.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHOWN_DIR = "/home/you/work"        # the scratch directory as the README shows it
BLOCK = re.compile(r"^```(console|python)([^\n]*)\n(.*?)^```$", re.M | re.S)
TABLE_COMMAND = re.compile(r"`((?:planner|torchrun|python) [^`]+)`")
FILES = {"examples/hf-config.json": "config.json"}   # what the README's commands read, as a user has it
TIMEOUT_S = 600


@dataclass(frozen=True)
class Command:
    text: str            # as shown, continuation lines included
    output: list[str]    # as shown


def commands_of(body: str) -> list[Command]:
    out, lines, i = [], body.rstrip("\n").split("\n"), 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        text = [lines[i][2:]]
        while text[-1].endswith("\\"):
            i += 1
            text.append(lines[i])
        i += 1
        start = i
        while i < len(lines) and not lines[i].startswith("$ "):
            i += 1
        out.append(Command("\n".join(text), lines[start:i]))
    return out


def run(command: str, scratch: Path, bin_dir: Path) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", COLUMNS="100", TERM="dumb", NO_COLOR="1",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    text = (proc.stdout + proc.stderr).replace(str(scratch), SHOWN_DIR)
    # progress lines, torch's timestamped log lines and what optional libraries log when they load vary from
    # run to run and from one installation to another: not shown
    return proc.returncode, [line.rstrip() for line in text.splitlines() if not line.startswith("searching:")
                             and not re.match(r"(\[rank\d+\]:)?[WI]\d{4} ", line) and "Failed to load" not in line]


LOSS = re.compile(r"loss ([0-9]+\.[0-9]+)")
LOSS_RTOL = 1e-3   # the same float32 step on another CPU (its SIMD reductions) moves a loss by ~3e-5 relative


def normal(line: str) -> str:
    """What may differ between runs, fixed: search times; losses, which `same` compares apart."""
    line = re.sub(r"solved in [0-9.]+ s \([0-9.]+ CPU s\)", "solved in N s (N CPU s)", line)
    return LOSS.sub("loss L", line)


def same(shown_line: str, now_line: str) -> bool:
    """The line as shown and as printed now agree: the same text once normalised, each loss within LOSS_RTOL."""
    losses = [(float(a), float(b)) for a, b in zip(LOSS.findall(shown_line), LOSS.findall(now_line))]
    return normal(shown_line) == normal(now_line) and all(abs(a - b) <= LOSS_RTOL * abs(a) for a, b in losses)


def shown(output: list[str], limit: int | None) -> list[str]:
    if limit is None or len(output) <= limit:
        return output
    return output[:limit] + [f"... ({len(output) - limit} more lines)"]


def limit_of(info: str) -> int | None:
    found = re.search(r"lines=(\d+)", info)
    return int(found.group(1)) if found else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    parser.add_argument("--bin", default=str(ROOT / ".venv" / "bin"), help="where planner, torchrun, python are")
    args = parser.parse_args(argv)
    text = README.read_text()
    scratch = Path(tempfile.mkdtemp(prefix="readme-"))
    for source, name in FILES.items():
        shutil.copy(ROOT / source, scratch / name)
    problems, pieces, last = [], [], 0
    try:
        for match in BLOCK.finditer(text):
            kind, info, body = match.groups()
            pieces.append(text[last:match.start(3)])
            pieces.append(body if kind == "python" else rendered(body, info, scratch, Path(args.bin), problems))
            if kind == "python":
                code, output = run(f"python - <<'PY'\n{body}PY", scratch, Path(args.bin))
                if code:
                    problems.append(f"python block failed ({code}):\n" + "\n".join(output[-15:]))
            last = match.end(3)
        pieces.append(text[last:])
        for command in TABLE_COMMAND.findall(text.split("## Tasks", 1)[-1].split("\n## ", 1)[0]):
            code, output = run(command, scratch, Path(args.bin))
            if code:
                problems.append(f"$ {command}\nexited {code}:\n" + "\n".join(output[-15:]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.write:
        README.write_text("".join(pieces))
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{'checked' if args.check else 'wrote'} README.md: {len(problems)} problem(s)")
    return 1 if problems else 0


def rendered(body: str, info: str, scratch: Path, bin_dir: Path, problems: list[str]) -> str:
    """The block with each command's output as it runs now; a difference from what was shown is a problem."""
    limit, lines = limit_of(info), []
    for command in commands_of(body):
        code, output = run(command.text.replace("\\\n", " "), scratch, bin_dir)
        now = shown(output, limit)
        if code:
            problems.append(f"$ {command.text}\nexited {code}:\n" + "\n".join(output[-15:]))
        elif len(now) != len(command.output) or not all(map(same, command.output, now)):
            problems.append(f"$ {command.text}\nprints otherwise than README.md shows:\n" + "\n".join(
                f"  shown: {a!r}\n  now:   {b!r}" for a, b in zip(command.output + [""] * len(now),
                                                               now + [""] * len(command.output))
                if not same(a, b))[:3000])
        lines += [f"$ {command.text}"] + now
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
