"""parallel-planner: capture, cost, search and apply parallel layouts for LLM training.

    import planner
    plan = planner.plan("llama3-70b", "dgx-h100", num_devices=1024, global_batch=1024, tp=8)
    estimate = planner.evaluate("gpt3-175b", "dgx-a100", "tp=8,pp=16,dp=8", global_batch=1536)
    report = planner.whatif("llama3-70b", sweep="num-devices=512,1024", device="h100-sxm", global_batch=1024)
    plan.save("plan.yaml"); planner.Plan.load("plan.yaml")

The names below load on first use, so that `import planner.plans` (what the runtime reads) does not pull
in the search and OR-Tools.
"""
from importlib import import_module

_EXPORTS = {"plan": "api", "evaluate": "api", "InfeasibleError": "api", "whatif": "whatif", "Report": "whatif",
            "capture": "capture.model_capture", "ModelGraph": "capture.graph", "Plan": "plans"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
