"""The product as users get it: the wheel built from this checkout, installed into a clean virtual environment
with the tested torch, runs every command the README shows and prints what the README shows, from a
directory outside the checkout with nothing of the repository on the path (tools/readme_examples.py)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.installed
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The venv's bin directory, the built wheel installed with the constraints' pins."""
    work = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(ROOT)], check=True, cwd=work)
    wheel = next((work / "dist").glob("parallel_planner-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    subprocess.run([str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                    str(ROOT / "constraints.txt"), f"{wheel}[examples]"], check=True, cwd=work)
    return work / "venv" / "bin"


def test_the_wheel_holds_every_file_read_at_run_time(installed):
    """Profiles, stacks and models: every YAML of the packages (a wheel without the stacks could not plan)."""
    wheel = next(installed.parent.parent.glob("dist/parallel_planner-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {str(path.relative_to(ROOT)) for package in ("hardware_profiles", "planner")
              for path in (ROOT / package).rglob("*.yaml")} | {"runtime/examples/corpus.txt"}
    assert wanted and wanted <= names
    assert any(name.endswith("licenses/LICENSE") for name in names)


def test_every_readme_command_runs_installed_and_prints_what_the_readme_shows(installed):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_examples.py"), "--check", "--bin",
                           str(installed)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
