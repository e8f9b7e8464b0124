"""The conventions users bring from torchrun, Megatron and torchtitan: -h, --version, --json on every command
(a refusal too), the closest real flag for a mistyped one, tables that keep their numbers whole in an
80-column pipe, and small jobs that plan without flags."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from test_cli import PLANNER, run


@pytest.mark.parametrize("command", ["plan", "evaluate", "whatif", "export", "replan", "calibrate", "models list",
                                     "models show", "profiles list", "profiles show", "stacks list", "stacks show"])
def test_every_command_takes_h_and_json(command):
    short, long = run(f"{command} -h"), run(f"{command} --help")
    assert short.stdout == long.stdout and short.stdout.startswith("Usage:")
    assert "--json" in short.stdout


def test_version_needs_no_heavy_imports():
    out = subprocess.run([PLANNER, "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert re.fullmatch(r"parallel-planner \S+\n", out.stdout)


@pytest.mark.parametrize("command", ["models list", "profiles list", "profiles show h100-sxm", "stacks list",
                                     "stacks show torchtitan"])
def test_list_and_show_commands_print_json(command):
    json.loads(run(f"{command} --json").stdout)


@pytest.mark.parametrize("args,field", [
    ("plan --model llama3-70b --device h100-sxm --num-devices 8 --global-batch 8", "--num-devices"),   # infeasible
    ("plan --model tiny-llama --device h100-sxm --num-devices 8 --global-batch 8 --fix tp=3", "--fix"),
    ("plan --model tiny-llama --device h100-sxm --num-devices 8", "--global-batch"),    # missing option
    ("plan --model tiny-llama --device h100-sxm --num-devices x --global-batch 8", "--num-devices"),   # bad value
])
def test_a_refusal_with_json_is_a_json_error_and_status_2(args, field):
    proc = run(f"{args} --json", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["field"] == field and error["text"] in " ".join(proc.stderr.split()) + error["text"]


@pytest.mark.parametrize("typed,meant", [("--outt", "--out"), ("--global-bath", "--global-batch"),
                                         ("--num-device", "--num-devices"), ("--time-limt", "--time-limit")])
def test_a_mistyped_flag_is_answered_with_the_closest_real_one(typed, meant):
    proc = run(f"plan --model tiny-llama --device cpu --num-devices 2 --global-batch 8 {typed} 1", check=False)
    assert proc.returncode == 2
    assert f"Expected {meant} " in " ".join(proc.stderr.split())


def test_the_whatif_table_keeps_its_numbers_whole_in_an_80_column_pipe():
    """Piped, rich lays tables out at 80 columns: columns are left out (and named), digits never cut."""
    out = subprocess.run([PLANNER, "whatif", "--model", "llama3-70b", "--device", "h100-sxm", "--sweep",
                          "num-devices=512,1024", "--global-batch", "1024", "--tokens", "15T"],
                         capture_output=True, text=True, timeout=300, check=True, env={"PATH": "/usr/bin"}).stdout
    assert "…" not in out and "..." not in out and "15T tokens" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert re.search(r"\b\d{3},\d{3}\b", out) and "left out at 80 columns" in out
    # each point's step time keeps its 90% band beside it (issue 43), whatever else the width leaves out
    points = [line for line in out.splitlines() if re.match(r"│\s+\d+ │", line)]
    assert "step 90%" in out and len(points) == 2
    assert all(re.search(r"│\s+\d+\.\d\d │\s+\d+\.\d\d-\d+\.\d\d │", line) for line in points)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_job_smaller_than_a_node_plans_inside_one(count):
    """--device cpu --num-devices 2 was refused ('do not fill whole nodes of 8')."""
    data = json.loads(run(f"plan --model tiny-llama --device cpu --num-devices {count} --global-batch 8 "
                          "--stack parallel-planner --json").stdout)
    assert data["num_devices"] == count and data["devices_per_node"] == count


def test_the_whatif_report_writes_the_budget_as_given_and_no_empty_column(tmp_path):
    run(f"whatif --model tiny-llama --device h100-sxm --sweep num-devices=16,32 --global-batch 32 --tokens 15T "
        f"--out {tmp_path}")
    page = (tmp_path / "whatif.html").read_text()
    assert "Token budget 15T" in page
    # a note column only where some point has something to say: here each plan lies outside the measured region
    # (tiny-llama's 256-wide layers), which the column says, and nothing else
    assert ("<th>note</th>" in page) == ("outside the measured region" in page)
    assert "crosses a scale-up domain" not in page and "does not fit" not in page
