"""parallel-planner: capture, cost, search and apply parallel layouts for LLM training.

    import planner
    plan = planner.plan("llama3-70b", "dgx-h100", num_devices=1024, global_batch=1024, tp=8)
    estimate = planner.evaluate("gpt3-175b", "dgx-a100", "tp=8,pp=16,dp=8", global_batch=1536)
    report = planner.whatif("llama3-70b", sweep="num-devices=512,1024", device="h100-sxm", global_batch=1024)
    plan.save("plan.yaml"); planner.Plan.load("plan.yaml")
"""
from .api import InfeasibleError, evaluate, plan
from .graph import ModelGraph
from .model_capture import capture
from .plans import Plan
from .whatif import Report, whatif

__all__ = ["plan", "evaluate", "whatif", "capture", "Plan", "Report", "ModelGraph", "InfeasibleError"]
