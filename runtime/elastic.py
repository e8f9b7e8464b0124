"""Elastic re-planning: a job started (or restarted by torchrun on the nodes left) with a plan for another
number of devices than it has ranks trains the plan `planner.api.replan` makes for the ranks there are.
Rank 0 plans and broadcasts the answer, so every rank trains the same plan (one search, one answer)."""
from __future__ import annotations

import json
import sys

import torch.distributed as dist

from hardware_profiles.errors import UserInputError
from planner.plans import Plan

from .dims import PlanError


def plan_for_ranks(plan: Plan, model: str, elastic: bool) -> Plan:
    """`plan` when the job has its number of ranks; otherwise, with `elastic`, the plan for the ranks there are
    (every rank told why when there is none), else a refusal naming the mismatch."""
    ranks = dist.get_world_size()
    if plan.num_devices == ranks:
        return plan
    if not elastic:
        raise PlanError(f"the plan is for {plan.num_devices} devices but the job has {ranks} "
                        f"rank{'s' if ranks != 1 else ''} (--elastic plans again for the ranks there are)")
    from planner.api import replan   # the search, needed only here
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer = [{"plan": replan(plan, ranks, model=model).model_dump(mode="json")}]
        except (UserInputError, ValueError) as exc:   # every rank is told, none waits for a plan that never comes
            answer = [{"error": f"--elastic: no plan for {ranks} ranks: {exc}"}]
    dist.broadcast_object_list(answer, src=0)
    if "error" in answer[0]:
        raise PlanError(answer[0]["error"])
    new = Plan.model_validate(json.loads(json.dumps(answer[0]["plan"])))
    if dist.get_rank() == 0:
        print(f"note: {new.reasons[0]}", file=sys.stderr, flush=True)
    return new
