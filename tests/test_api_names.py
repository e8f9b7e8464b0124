"""The names `planner` exports keep their documented types whatever was used before them (`planner.capture`
was the capture subpackage once `planner.plan` had run, and 'module' object is not callable)."""
from __future__ import annotations

import inspect
import subprocess
import sys

import planner

DOCUMENTED = {"plan": "function", "evaluate": "function", "replan": "function", "whatif": "function",
              "capture": "function", "job_of": "function", "Plan": "class", "ModelGraph": "class", "Job": "class",
              "Report": "class", "InfeasibleError": "exception", "UserInputError": "exception",
              "__version__": "str"}


def kind(value) -> str:
    if inspect.isclass(value):
        return "exception" if issubclass(value, BaseException) else "class"
    if inspect.isfunction(value):
        return "function"
    return type(value).__name__


def test_every_exported_name_is_documented():
    assert set(planner.__all__) == set(DOCUMENTED)


def test_each_name_keeps_its_type_after_every_other_name_was_used():
    """In a fresh interpreter, each name read after all the others have been read and called once."""
    code = ("import planner\n"
            "planner.plan('tiny-llama', device='cpu', num_devices=2, global_batch=4, time_limit_s=30)\n"
            "planner.capture('tiny-llama')\n"
            f"names = {sorted(DOCUMENTED)!r}\n"
            "for name in names: getattr(planner, name)\n"
            "import inspect\n"
            "print(' '.join(f'{n}={type(getattr(planner, n)).__name__}' for n in names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    types = dict(item.split("=") for item in out.stdout.split())
    assert types["capture"] == "function" and types["plan"] == "function" and types["__version__"] == "str"
    for name, documented in DOCUMENTED.items():
        assert kind(getattr(planner, name)) == documented, name


def test_no_submodule_shares_a_name_with_an_exported_one():
    """A submodule imported by anything sets the package attribute of its name: an exported function of that
    name would become the module (as planner.capture and planner.whatif did)."""
    from pathlib import Path
    package = Path(planner.__file__).parent
    modules = {p.stem for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not set(planner.__all__) & modules
