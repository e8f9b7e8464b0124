"""The Python API: `plan`, `evaluate` and `replan` of a `Job` (`planner/job.py`), and the functions that take
what a user states and build the job first."""
from __future__ import annotations

from dataclasses import dataclass

import time
from dataclasses import replace

from cost_models.layout import Layout, MoeDispatcher, Recompute
from cost_models.layout_codec import FIELDS, FULL_KEYS, layout_from, parse_text, parse_values, text_of
from cost_models.memory import usable_bytes
from cost_models.step_time import estimate
from hardware_profiles.errors import UserInputError
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import A2A_OVERLAP_DISPATCHERS, SoftwareStack

from .region import job_outside_notes, measured_bounds, measured_dispatchers, overlap_measured, zero3_ranks_max
from .graph_capture.graph import ModelGraph
from .job import Job, check_count, job_of, plan_cluster, plan_device
from .placement import placement_choices, placement_reason
from .plans import Alternative, Plan
from .search.branch_and_bound import SearchCaches, search
from .search.offload_leaf import offload_where_needed
from .search.space import with_tp_overlap
from .search.tree import SearchOutcome
from .plan_building import build_plan
from .rules.device import check_device_for, check_overlaps_on
from .rules.layout import layout_problems, pin_problems
from .rules.pins import Pins
from .rules.stack import (a2a_overlap_left_off, a2a_overlap_refusal, layout_stack_problems, module_choices,
                          recompute_choices, stack_pins, stack_problems, uniform_recompute)


class InfeasibleError(UserInputError):
    """No layout fits: says the smallest memory need found, its dominant part and how many devices would."""


def check_time_limit(seconds) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise UserInputError(f"{seconds!r}", field="--time-limit", expected="a finite number of seconds >= 0")


def _infeasible(graph: ModelGraph, cluster: Cluster, global_batch: int, outcome: SearchOutcome,
                pins: Pins, precision: str, stack: SoftwareStack, pins_field: str = "--fix") -> InfeasibleError:
    capacity = usable_bytes(cluster.device)
    need = outcome.smallest_memory_need
    if outcome.unexplored and (need <= capacity or need == float("inf")):   # inf: cut before any was sized
        return InfeasibleError(f"the search reached its time limit after {outcome.wall_s:.0f} s with "
                               f"{outcome.unexplored} of {outcome.candidates} candidate layouts unexplored and "
                               f"no plan found yet for {graph.name} on {cluster.num_devices} x {cluster.device.name}",
                               field="--time-limit", expected="a longer time limit, or pins (--fix) that narrow "
                               "the space")
    if outcome.unproven and need <= capacity:
        return InfeasibleError(f"{outcome.unproven} stage partitions stopped at the solver's work limit without a "
                               f"plan or a proof that none fits, and no plan was found for {graph.name} on "
                               f"{cluster.num_devices} x {cluster.device.name}", field=pins_field,
                               expected="pins (--fix) that narrow the space, e.g. the pipeline degree")
    if need == float("inf") and pins.shape_bounds:   # the search inside the measured region (_beside_inside)
        kept = ", ".join(f"{b.degree} with {b.total:,} // {b.degree} in {b.low:,}-{b.high:,}" for b in pins.shape_bounds)
        return InfeasibleError(f"no layout of {cluster.num_devices} devices both divides this model and batch and "
                               f"keeps its per-rank shapes inside the measured ranges ({kept})", field="layout",
                               expected="a device count and batch that a layout inside the measured region divides")
    if need == float("inf"):
        return InfeasibleError(f"no layout of {cluster.num_devices} devices divides this model and batch "
                               f"({graph.attention_heads} heads, {graph.num_blocks} layers, global batch "
                               f"{global_batch})", field="layout", expected="a device count and batch that the "
                               "heads, layers and batch divide")
    dominant = max(outcome.smallest_need_parts, key=outcome.smallest_need_parts.get)
    paired = bool(pins.a2a_overlap and stack.moe_a2a_overlap)   # combined 1F1B pinned: no full recomputation
    fewest = _fewest_devices(graph, cluster, global_batch, pins, precision, stack)
    more = f"; about {fewest} {cluster.device.name} devices would fit" if fewest else ""
    return InfeasibleError(
        f"{graph.name} does not fit {cluster.num_devices} x {cluster.device.name}: the smallest memory need "
        f"found is {need / 1e9:.1f} GB per device against {capacity / 1e9:.1f} GB usable, dominated by "
        f"{dominant.replace('_', ' ')} ({outcome.smallest_need_parts[dominant] / 1e9:.1f} GB){more}"
        + ("; a2a_overlap=true (combined 1F1B) is pinned, beside which no layer recomputes fully" if paired else ""),
        field="--num-devices", expected="more devices, a larger device, a smaller batch or sequence"
        + (", or a2a_overlap=false" if paired else ""))


def _fewest_devices(graph, cluster, global_batch, pins, precision, stack) -> int | None:
    from .search.bounds import Bounds
    from .search.space import candidate_layouts
    bounds = Bounds(graph.costs_record, cluster, stack, recompute_choices(pins, stack))
    count = cluster.num_devices
    for _ in range(12):
        count *= 2
        layouts = candidate_layouts(graph, count, global_batch, pins, precision, cluster.fast_domain_devices)
        if any(bounds.memory_floor(lay)[0] <= usable_bytes(cluster.device) for lay in layouts):
            return count
    return None


def plan(model, cluster=None, *, global_batch: int, seq_len: int | None = None, precision: str | None = None,
         device: str | None = None, num_devices: int | None = None, devices_per_node: int | None = None,
         segment_devices: int | None = None, time_limit_s: float = 60.0, top_k: int = 3, stack=None,
         ep_imbalance: float = 1.0, leaf_modules: tuple[str, ...] = (), strict_capture: bool = False, progress=None,
         **fix) -> Plan:
    """Search the fastest layout that fits: `planner.plan("llama3-70b", "dgx-h100", global_batch=1024, tp=8)`.

    `model`: a built-in name, model YAML, HF config.json path or dict, `file.py:factory`, or nn.Module.
    `cluster`: a profile name, path or `Cluster`; or give `device=` and `num_devices=`.
    `segment_devices`: the devices the job takes in each scale-up domain, in equal segments (Slurm --segment);
    a whole domain's count states packing; None: the search chooses (planner/placement.py).
    `stack`: the software stack that will train it (a name such as "torchtitan", a YAML path or a
    `SoftwareStack`; Megatron-Core's defaults when omitted). The search stays inside what it can run.
    `fix`: pinned layout fields (dp, tp, pp, vp, cp, ep, etp, mbs, zero, recompute, sp, grad_reduce, fp8_recipe,
    recompute_modules: else chosen with the partition where the stack has more than core_attn).
    `strict_capture`: refuse a model that capture could only bill in part (see Plan.capture_notes).
    """
    check_time_limit(time_limit_s)
    deadline = time.perf_counter() + time_limit_s   # capture counts against the limit
    values = pin_values(parse_values(fix, "fix"))
    job = job_of(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision, device=device,
                 num_devices=num_devices, devices_per_node=devices_per_node, segment_devices=segment_devices,
                 stack=stack, ep_imbalance=ep_imbalance, leaf_modules=leaf_modules, strict_capture=strict_capture,
                 layout_values=values)
    return plan_job(job, time_limit_s, top_k, progress, deadline=deadline)


def pin_values(values: dict) -> dict:
    """Typed values by key as pins: everything but a whole pipeline split, which the search chooses."""
    if "stages" in values:
        raise UserInputError("stages= gives a whole pipeline split, which the search chooses", field="--fix",
                             expected="stages= in planner evaluate --layout, with every degree given")
    return values


def plan_job(job: Job, time_limit_s: float = 60.0, top_k: int = 3, progress=None, pins_field: str = "--fix",
             deadline: float | None = None) -> Plan:
    """Search the job's fastest layout inside what its stack runs, its pins kept (named as `pins_field`), by
    `deadline` (a `time.perf_counter()` instant; else `time_limit_s` from now)."""
    deadline = time.perf_counter() + time_limit_s if deadline is None else deadline
    stack, graph, cluster, pins = job.stack, job.graph, job.cluster, job.pins
    problems = stack_problems(pins, stack, job.precision, graph) + pin_problems(pins, graph, cluster.num_devices,
                                                                              job.global_batch)
    if problems:
        raise UserInputError("no layout can satisfy the pins: " + "; ".join(problems), field=pins_field,
                             expected=f"pins that the model, the device count, the batch and the {stack.name} "
                             "stack allow")
    if pins.tp and pins.tp > 1:
        check_overlaps_on(cluster, pins.tp, bool(pins.tp_overlap), bool(pins.a2a_overlap))
    pins = stack_pins(pins, stack, graph)
    if deadline - time.perf_counter() <= 0:
        raise InfeasibleError(f"capturing {graph.name} took {graph.capture_seconds:.1f} s and no time of "
                              f"--time-limit was left to search", field="--time-limit",
                              expected="a time limit longer than the capture")
    caches: dict[Cluster, SearchCaches] = {}   # per placement: its searches share layer costs and leaf answers
    result, placed = _best_placement(job, cluster, pins, top_k, progress, pins_field, deadline, caches)
    if pins.tp_overlap and pins.a2a_overlap and SoftwareStack.tp_overlap_blocked_by_a2a(2, cluster.device):
        result = result.model_copy(update={"reasons": result.reasons + [
            f"tp_overlap=true and a2a_overlap=true are both pinned: on {cluster.device.name} a layout runs only one of "
            "them at tp > 1 (one CUDA connection against several), so the search kept to tp = 1"]})
    idle = [f"{key}=true" for key in ("sp", "tp_overlap") if getattr(pins, key)] if result.layout.tp == 1 else []
    if idle:   # pins of the tensor-parallel group, which a tp = 1 plan has not: said, as Megatron turns them off
        result = result.model_copy(update={"reasons": result.reasons + [
            f"{' and '.join(idle)} pinned, and the plan runs tp = 1: there is no tensor-parallel group to split the "
            f"sequence or overlap collectives over, so {'it does' if len(idle) == 1 else 'they do'} nothing here "
            f"(Megatron turns --sequence-parallel off at tp 1); pin tp > 1 as well to keep "
            f"{'it' if len(idle) == 1 else 'them'}"]})
    return _beside_inside(job, result, placed, pins, pins_field, deadline, caches)


def _best_placement(job: Job, cluster: Cluster, pins, top_k: int, progress, pins_field: str, deadline: float,
                    caches: dict) -> tuple[Plan, Cluster]:
    """The fastest plan over the placements of the job's devices (planner/placement.py), and its placement."""
    choices = placement_choices(cluster)
    if len(choices) == 1:
        return _plan_on(job, cluster, pins, top_k, progress, pins_field, deadline, caches), cluster
    tried, plans, refusals = [], [], []
    for index, placed in enumerate(choices):   # each the time left, shared with the placements after it
        share = time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / (len(choices) - index)
        try:
            plans.append((_plan_on(job, placed, pins, top_k, progress, pins_field, share, caches), placed))
            tried.append((placed, plans[-1][0].step_time_s))
        except UserInputError as exc:   # no plan on this placement (memory, or its share of the time)
            refusals.append(exc)
            tried.append((placed, None))
    if not plans:
        raise refusals[0]   # packed: the placement a user without segments gets
    return _placement_chosen(plans, tried)


def _placement_chosen(plans: list[tuple[Plan, Cluster]], tried) -> tuple[Plan, Cluster]:
    best, chosen = min(plans, key=lambda pair: pair[0].step_time_s)
    return best.model_copy(update={"reasons": best.reasons + [placement_reason(chosen, tried)]}), chosen


def _beside_inside(job: Job, result: Plan, cluster: Cluster, pins, pins_field: str, deadline: float,
                   caches: dict) -> Plan:
    """Where the plan lies outside the region the published runs measured, the best plan inside it (its per-rank
    shapes kept to the measured ranges, on the same placement, in the time left) beside it: where a model is
    least right is where a search's optimum tends to lie."""
    if not result.outside_measured:
        return result
    graph = job.graph
    device = cluster.device.name
    beyond = job_outside_notes(graph.seq_len, graph.hidden_size, graph.num_experts)
    if beyond:
        return result.model_copy(update={"reasons": result.reasons + beyond})
    # combined 1F1B kept off inside where no published run on the device ran it (and the user left it open)
    overlap_off = pins.a2a_overlap is None and not overlap_measured(graph.num_experts, device)
    inside_pins = replace(pins, shape_bounds=measured_bounds(graph.seq_len, graph.hidden_size, graph.num_experts),
                          measured_dispatchers=measured_dispatchers(graph.num_experts, device),
                          zero3_ranks_max=zero3_ranks_max(graph.num_experts),
                          a2a_overlap=False if overlap_off else pins.a2a_overlap,
                          offload_layers=0 if pins.offload_layers is None else pins.offload_layers)
    try:
        inside = _plan_on(job, cluster, inside_pins, 1, None, pins_field, deadline, caches)
    except UserInputError as exc:   # none fits there, or no time is left to look
        return result.model_copy(update={"reasons": result.reasons + [
            f"no plan inside the measured region was found: {exc.args[0] if exc.args else exc}"]})
    if inside.outside_measured:   # the pins keep every plan outside (e.g. a pinned offload_layers)
        return result.model_copy(update={"reasons": result.reasons + [
            f"no plan inside the measured region with these pins: {inside.outside_measured[0]}"]})
    slower = inside.step_time_s / result.step_time_s - 1
    return result.model_copy(update={"inside_measured": Alternative(
        layout=text_of(inside.to_layout()), step_time_s=inside.step_time_s, mfu=inside.mfu,
        loses=f"{slower:+.1%} step time predicted, inside the measured region")})


def _plan_on(job: Job, cluster, pins, top_k: int, progress, pins_field: str, deadline: float,
             caches: dict | None = None) -> Plan:
    """The search on one placement of the job's devices (`caches`: by placement, what its searches share)."""
    stack, graph = job.stack, job.graph
    # a stack that checkpoints every layer or none: one search per method, the fastest plan wins
    methods = [(r,) for r in recompute_choices(pins, stack)] if uniform_recompute(pins, stack) \
        else [recompute_choices(pins, stack)]
    modules = module_choices(pins, stack, graph, job.precision)
    outcomes = []
    for index, allowed in enumerate(methods):   # each the time left, shared with the searches after it
        share = max(deadline - time.perf_counter(), 0.0) / (len(methods) - index)
        outcomes.append(search(graph.costs_record, cluster, job.global_batch, pins, job.precision, share,
                               max(top_k, 1), stack=stack, ep_imbalance=job.ep_imbalance, graph=graph,
                               progress=progress, recompute_choices=allowed,
                               caches=None if caches is None else caches.setdefault(cluster, SearchCaches()),
                               module_choices=modules if Recompute.none in allowed else ()))
    found = [o for o in outcomes if o.ranked]
    if not found:
        raise _infeasible(graph, cluster, job.global_batch, outcomes[0], pins, job.precision, stack, pins_field)
    best = min(found, key=lambda o: o.ranked[0].estimate.step_time_s)
    result = build_plan(graph, cluster, best.ranked[0].estimate, best, stack, job.ep_imbalance)
    if len(methods) > 1:
        tried = ", ".join(f"{allowed[0]}: " + (f"{o.ranked[0].estimate.step_time_s:.3f} s" if o.ranked else "no fit")
                          for allowed, o in zip(methods, outcomes))
        result = result.model_copy(update={"reasons": result.reasons + [
            f"the {stack.name} stack recomputes every layer or none; searched each ({tried})"]})
    return result


def stack_defaults(values: dict, stack: SoftwareStack) -> dict:
    """Layout values with what the text leaves open taken from the stack (`LayoutField.stack_default`: gradient
    dtype, FP8 recipe, SP, and combined 1F1B where the stack runs it)."""
    filled = {key: declared.field.stack_default(stack) for key, declared in FIELDS.items()
              if declared.field.stack_default is not None}
    return parse_values({**{k: v for k, v in filled.items() if v is not None}, **values}, "stack")


def evaluate(model, cluster=None, layout: str | dict | Layout = "", *, global_batch: int,
             seq_len: int | None = None, precision: str | None = None, device: str | None = None,
             num_devices: int | None = None, devices_per_node: int | None = None,
             segment_devices: int | None = None, stack=None, ep_imbalance: float = 1.0, time_limit_s: float = 60.0,
             leaf_modules: tuple[str, ...] = (), strict_capture: bool = False) -> Plan:
    """Predict a given layout under a software stack (`plan`'s `stack`). Fields left out are searched; a
    layout that does not divide, fit or run on the stack is explained."""
    check_time_limit(time_limit_s)
    deadline = time.perf_counter() + time_limit_s
    values = {} if isinstance(layout, Layout) else layout_values(layout)
    job = job_of(model, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision, device=device,
                 num_devices=num_devices, devices_per_node=devices_per_node, segment_devices=segment_devices,
                 stack=stack, ep_imbalance=ep_imbalance, leaf_modules=leaf_modules, strict_capture=strict_capture,
                 layout_values=values)
    return evaluate_job(job, layout if isinstance(layout, Layout) else values, time_limit_s, deadline)


def evaluate_job(job: Job, layout: dict | Layout, time_limit_s: float = 60.0, deadline: float | None = None) -> Plan:
    """The job's prediction for `layout` (typed values by key, or a `Layout`): a whole layout as given, with the
    searched settings it leaves out weighed as the search weighs them and the rest taken from the stack; a
    partial one searched with its fields pinned."""
    if isinstance(layout, Layout):
        return predict(job, replace(layout, global_batch=job.global_batch))
    if not set(FULL_KEYS) <= set(layout):  # search the rest with these pinned
        return plan_job(job, time_limit_s, pins_field="--layout", deadline=deadline)
    given = {key: value for key, value in layout.items() if key not in ("precision", "gbs")}
    plans = [predict(job, _offload_left_out(_tp_overlap_left_out(
        layout_from(stack_defaults(choice, job.stack), global_batch=job.global_batch, precision=job.precision),
        given, job), given, job)) for choice in settings_left_out(given, job)]
    # the settings the layout leaves out, as the search chooses them: the faster plan that fits
    return min(plans, key=lambda p: (not p.fits, p.step_time_s))


def settings_left_out(given: dict, job: Job) -> list[dict]:
    """A whole layout's values with each searched setting it leaves out taken every way the stack can run it
    for this model (each MoE dispatcher the stack runs on the device where experts spread, combined 1F1B on and
    off where the stack has it); the stack's default for the rest."""
    if "dispatcher" in given or given["ep"] == 1:
        dispatched = [given]
    else:   # a pinned combined 1F1B takes the dispatchers that run it
        dispatched = [{**given, "dispatcher": MoeDispatcher(d)} for d in job.stack.dispatchers_on(job.cluster.device)
                      if not given.get("a2a_overlap") or d in A2A_OVERLAP_DISPATCHERS]
    return [choice for values in dispatched for choice in _overlaps_left_out(values, job)]


def _tp_overlap_left_out(layout: Layout, given: dict, job: Job) -> Layout:
    """TP communication overlap as given, else as the search chooses it for the layout (`with_tp_overlap`)."""
    return layout if "tp_overlap" in given else with_tp_overlap(layout, job.stack, job.cluster.device, None)


def _offload_left_out(layout: Layout, given: dict, job: Job) -> Layout:
    """Activation offloading as given, else as the search takes it (`offload_where_needed`)."""
    return layout if "offload_layers" in given else offload_where_needed(job.graph.costs_record, job.cluster, layout,
                                                                          job.stack, job.ep_imbalance)


def _overlaps_left_out(given: dict, job: Job) -> list[dict]:
    """Combined 1F1B as given, else on and off where the stack can pair the layout's passes, else off."""
    if "a2a_overlap" in given:
        return [given]
    if not job.stack.moe_a2a_overlap or a2a_overlap_refusal(given["pp"], job.graph) \
            or a2a_overlap_left_off(job.stack, job.cluster.device) \
            or given.get("dispatcher") not in (None, *A2A_OVERLAP_DISPATCHERS):
        return [{**given, "a2a_overlap": False}]
    return [{**given, "a2a_overlap": on} for on in (False, True)]


def layout_values(layout) -> dict:
    """Typed values by key of layout text or a dict; stages only beside a whole layout."""
    if not isinstance(layout, (str, dict)):
        raise UserInputError(f"{type(layout).__name__}", field="layout",
                             expected="layout text ('tp=8,pp=2'), a dict of fields or a Layout")
    values = parse_text(layout) if isinstance(layout, str) else parse_values(layout)
    if not set(FULL_KEYS) <= set(values) and "stages" in values:
        raise UserInputError("stages= needs the whole layout", field="--layout",
                             expected=f"every one of {', '.join(FULL_KEYS)} beside stages=")
    return values


def predict(job: Job, given: Layout) -> Plan:
    """The job's prediction for a whole layout, on the placement of its devices that runs it fastest where the
    user states none (planner/placement.py); refused where the stack or the model cannot run it."""
    choices = placement_choices(job.cluster)
    if len(choices) == 1:
        return _predict_on(job, job.cluster, given)
    plans = [(_predict_on(job, placed, given), placed) for placed in choices]
    return _placement_chosen(plans, [(placed, plan_.step_time_s) for plan_, placed in plans])[0]


def _predict_on(job: Job, cluster: Cluster, given: Layout) -> Plan:
    graph, stack = job.graph, job.stack
    refused = layout_stack_problems(given, stack, graph)
    if refused:
        raise UserInputError("the layout is not one the stack runs: " + "; ".join(refused), field="--layout",
                             expected=f"a layout the {stack.name} stack runs, or another --stack")
    check_device_for(cluster, stack, given.precision, given.fp8_recipe, given.moe_dispatcher if given.ep > 1 else None,
                     given.offload_layers)
    check_overlaps_on(cluster, given.tp, given.tp_comm_overlap, stack.hides_moe_a2a(given))
    problems = layout_problems(given, graph, cluster.num_devices)
    if problems:
        raise UserInputError("the layout is invalid: " + "; ".join(problems), field="--layout",
                             expected="degrees whose product is the device count and that divide the model, "
                             "and recompute modules it has")
    result = estimate(graph.costs_record, cluster, given, stack, job.ep_imbalance)
    plan_ = build_plan(graph, cluster, result, None, stack, job.ep_imbalance)
    if given.pp > 1 and given.stage_layers is None:
        plan_ = plan_.model_copy(update={"reasons": plan_.reasons + [
            "layers split evenly over the stages and recomputation as given (Megatron's defaults); plan with "
            "these degrees pinned also balances the split and recomputes per layer, as its alternatives do"]})
    held = result.stage_memory[0]
    if held.host_bytes > held.host_capacity:   # offloaded activations beyond the host memory (offload_layers)
        plan_ = plan_.model_copy(update={"reasons": [
            f"does not fit host memory: the {given.offload_layers} offloaded layers' activations need "
            f"{held.host_bytes / 1e9:.1f} GB per device, beyond the {held.host_capacity / 1e9:.0f} GB the device "
            "profile gives (host_memory_bytes)"] + plan_.reasons})
    elif not result.fits:
        worst = max(result.stage_memory, key=lambda s: s.total)
        part = max(worst.parts(), key=worst.parts().get)
        plan_ = plan_.model_copy(update={"reasons": [
            f"does not fit: stage {worst.stage} needs {worst.total / 1e9:.1f} GB of {worst.capacity / 1e9:.1f} GB "
            f"usable, mostly {part.replace('_', ' ')} ({worst.parts()[part] / 1e9:.1f} GB)"] + plan_.reasons})
    return plan_


@dataclass(frozen=True)
class CheckCadence:
    """The steps between the runtime's checks of computation that the goodput model chooses for a plan's job: those
    that lose least to their cost and to corruption found late (0: never)."""
    products_every_steps: int    # matrix products checked by their checksums (runtime/gemm_check.py)
    optimizer_every_steps: int   # a sample of each sharded update recomputed by another rank (optimizer_check.py)


def check_cadence(plan_: Plan, model=None) -> CheckCadence:
    """The goodput model's cadences for the plan's job (`model` where its name is not a built-in)."""
    from .goodput_report import plan_goodput
    job = _job_of_plan(plan_, plan_.num_devices, model)
    result = plan_goodput(plan_, plan_cluster(plan_), job.graph.total_params, job=job)
    return CheckCadence(result.recovery.product_check_every_steps or 0,
                        result.recovery.optimizer_check_every_steps or 0)


def _job_of_plan(plan_: Plan, num_devices: int, model=None) -> Job:
    """The job a plan was made for, at `num_devices`; `model` where its name is not a built-in."""
    from .graph_capture.model_sources import list_builtin_models
    if model is None:
        if plan_.model not in list_builtin_models():
            raise UserInputError(f"the plan's model '{plan_.model}' is not a built-in name", field="--model",
                                 expected="the model the plan was made for (--model NAME|FILE)")
        model = plan_.model
    return job_of(model, device=plan_device(plan_), num_devices=num_devices, devices_per_node=plan_.devices_per_node,
                  segment_devices=plan_.segment_devices, global_batch=plan_.layout.gbs, seq_len=plan_.seq_len,
                  precision=str(plan_.layout.precision), stack=plan_.stack, ep_imbalance=plan_.ep_imbalance)


def replan(plan_: Plan, num_devices: int, model=None, time_limit_s: float = 60.0) -> Plan:
    """The plan again for `num_devices` (a node lost, or gained): same model, device, nodes, batch, sequence,
    precision and stack; its `reasons` start with what changed. `model` is needed where the plan's model
    name is not a built-in (a file or module the plan cannot name)."""
    check_count("--num-devices", num_devices)
    job = _job_of_plan(plan_, num_devices, model)
    check_time_limit(time_limit_s)
    new = plan_job(job, time_limit_s)
    old, lay = plan_.layout, new.layout
    keys = [FIELDS[key].field.plan_key for key in FULL_KEYS]
    changed = [f"{key} {getattr(old, key)} -> {getattr(lay, key)}" for key in keys
               if getattr(old, key) != getattr(lay, key)]
    summary = (f"replanned from {plan_.num_devices} to {num_devices} devices, global batch {lay.gbs} kept: "
               f"{', '.join(changed) or 'same degrees'}; step {plan_.step_time_s:.3f} s -> {new.step_time_s:.3f} s")
    return new.model_copy(update={"reasons": [summary] + new.reasons})
