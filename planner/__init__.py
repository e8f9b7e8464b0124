"""parallel-planner: capture, cost, search and apply parallel layouts for LLM training.

    import planner
    plan = planner.plan("llama3-70b", "dgx-h100", num_devices=1024, global_batch=1024, tp=8)
    estimate = planner.evaluate("gpt3-175b", "dgx-a100", "tp=8,pp=16,dp=8", num_devices=1024, global_batch=1536)
    report = planner.whatif("llama3-70b", sweep="num-devices=512,1024", device="h100-sxm", global_batch=1024)
    plan.save("plan.yaml"); planner.Plan.load("plan.yaml")
    graph = planner.capture("llama3-8b")          # the model's captured graph (planner.ModelGraph)

The names below load on first use, so that `import planner.plans` (what the runtime reads) does not pull
in the search and OR-Tools. The capture package is `planner.graph_capture`: no subpackage shares a name
with a function here, so each name keeps its documented type whatever was imported before.
"""
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version

_EXPORTS = {"plan": "api", "evaluate": "api", "replan": "api", "InfeasibleError": "api", "whatif": "capacity",
            "Report": "capacity", "capture": "graph_capture.model_capture", "ModelGraph": "graph_capture.graph",
            "Plan": "plans", "Job": "job", "job_of": "job", "UserInputError": "job"}

__all__ = sorted(_EXPORTS) + ["__version__"]

try:
    __version__ = _version("parallel-planner")
except PackageNotFoundError:   # run from a checkout that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
