"""What a software stack can run, as pins and refusals: one rule set for the search and for `evaluate`.

The search never proposes a layout the stack lacks (a parallel degree, ZeRO stage, interleaving, sequence
parallelism, selective recomputation or FP8 recipe), and a pinned or given layout that needs one is refused
with the rule it breaks. Defaults the layout leaves open (gradient dtype, FP8 recipe) are the stack's.
"""
from __future__ import annotations

from dataclasses import replace

from cost_models.layout import Fp8Recipe, Layout, Precision, Recompute, RecomputeModule, Schedule
from cost_models.layout_codec import FIELDS, FULL_KEYS, values_of
from hardware_profiles.stack import A2A_OVERLAP_DISPATCHER_RULE, A2A_OVERLAP_DISPATCHERS, SoftwareStack

from .pins import DualPipeVRules, Pins, pins_from, splits_evenly

AXES = ("tp", "pp", "cp", "ep")


def model_problems(pins: Pins, stack: SoftwareStack, graph) -> list[str]:
    """What the stack cannot shard in this model (context or expert parallelism of layers it cannot split)."""
    if graph is None:
        return []
    name, problems = stack.name, []
    blocks = graph.structures
    if pins.cp and pins.cp > 1 and stack.context_parallel_attention == "reference" \
            and not all(b.reference_attention for b in blocks):
        problems.append(f"cp={pins.cp}: the {name} stack splits the sequence only for the reference decoder's "
                        f"attention (CoreAttention), which {graph.name} does not use")
    if pins.cp and pins.cp > 1 and stack.context_parallel_attention in ("sdpa", "reference") \
            and all(b.reference_attention for b in blocks) and any(b.sliding_window for b in blocks):
        problems.append(f"cp={pins.cp}: the {name} stack splits the sequence for the reference decoder's causal "
                        f"attention without a sliding window, and {graph.name}'s layers slide")
    if pins.cp and pins.cp > 1 and stack.context_parallel_attention == "sdpa" \
            and not all(b.reference_attention for b in blocks):
        if not all(b.sdpa_attention and not b.sliding_window for b in blocks):
            problems.append(f"cp={pins.cp}: the {name} stack splits the sequence for causal "
                            f"scaled_dot_product_attention without a sliding window, and {graph.name}'s attention "
                            "is not that")
        elif graph.embedding_weights_read:
            problems.append(f"cp={pins.cp}: {graph.name} reads {graph.embedding_weights_read[0]}'s weight directly "
                            f"(positions by the sequence length), which the {name} stack cannot make the global "
                            "positions of a sequence shard; call the embedding with position ids instead")
    if pins.ep and pins.ep > 1 and stack.expert_parallel_experts == "stacked" \
            and not all(b.stacked_experts for b in blocks if b.expert_container):
        problems.append(f"ep={pins.ep}: the {name} stack spreads only stacked expert weights (the reference "
                        f"MoE's, or an experts module called with the routing), which {graph.name}'s experts are not")
    if pins.etp and pins.etp > 1 and stack.expert_parallel_experts == "stacked" \
            and not all(b.reference_experts for b in blocks if b.expert_container):
        problems.append(f"etp={pins.etp}: the {name} stack splits experts' feed-forward width only in the reference "
                        f"MoE, which {graph.name}'s experts are not")
    if pins.pp and pins.pp > 1 and graph.front_end != "torch.fx" and stack.pipeline_models == "traceable":
        problems.append(f"pp={pins.pp}: the {name} stack cuts pipeline stages from a torch.fx trace of the model, "
                        f"and torch.fx cannot trace {graph.name} (capture recorded it instead)")
    if pins.pp and pins.pp > 1 and graph.front_end != "torch.fx" and stack.pipeline_models == "sequential":
        if not graph.block_stack:
            problems.append(f"pp={pins.pp}: the {name} stack cuts a recorded model into pipeline stages by its block "
                            f"list, and {graph.name}'s blocks are not one list")
        elif any(b.sliding_window for b in blocks):
            problems.append(f"pp={pins.pp}: the {name} stack runs a recorded model's own forward over each stage's "
                            f"blocks, and {graph.name} picks sliding-window masks by a layer's place in that loop")
    if pins.tp and pins.tp > 1 and stack.tensor_parallel_projections == "separate":
        fused = next((p.fused_columns[0] for b in blocks for p in b.tp_pairs if p.fused_columns), None)
        if fused:
            problems.append(f"tp={pins.tp}: the {name} stack column-splits only separate projections, and "
                            f"{graph.name}'s {fused} is one the model cuts into parts")
    return problems


def untrainable_parts(stack: SoftwareStack, graph=None) -> list[str]:
    """Parts of the model the stack cannot train at all, whatever the layout."""
    if graph is not None and graph.mtp_layers and not stack.multi_token_prediction:
        return [f"{graph.name} has {graph.mtp_layers} multi-token prediction module(s), which the {stack.name} "
                "stack does not train"]
    return []


def a2a_overlap_refusal(pp: int | None, graph=None) -> str | None:
    """Why combined 1F1B cannot run for this model at pipeline degree `pp` (None: any pp), or None: Megatron-Core's
    TransformerConfig takes at most one multi-token prediction module beside it, and with one a pipeline."""
    mtp = graph.mtp_layers if graph is not None else 0
    if mtp > 1:
        return (f"{graph.name} has {mtp} multi-token prediction modules; Megatron-Core runs combined 1F1B "
                "(--overlap-moe-expert-parallel-comm) beside one at most")
    if mtp == 1 and pp == 1:
        return (f"{graph.name} has a multi-token prediction module, beside which Megatron-Core runs combined 1F1B "
                "(--overlap-moe-expert-parallel-comm) only with pp > 1")
    return None


def a2a_overlap_left_off(stack: SoftwareStack, device) -> str | None:
    """Why the search and `evaluate` leave combined 1F1B off on this device under this stack (a pin keeps it), or
    None: where the device needs whole layers replayed as CUDA graphs for it to pay (`Device.a2a_overlap_needs_graphs`)
    and the stack does not replay them."""
    if not device.a2a_overlap_needs_graphs or (stack.cuda_graphs and stack.cuda_graph_scope == "layers"):
        return None
    return (f"on {device.name} combined 1F1B pays only beside whole layers replayed as CUDA graphs, which the "
            f"{stack.name} stack does not run: its stages' synchronisation adds more CPU overhead than the all-to-alls "
            "it hides over the NVLink domain save (Megatron-LM's DeepSeek-V3 GB200 guide: 'the overall benefit is "
            "negative on the GB200'; NVIDIA's 26.08 GB200 recipes run it beside full-iteration CUDA graphs; a stack "
            "profile with cuda_graphs: true and cuda_graph_scope: layers weighs it)")


def stack_problems(pins: Pins, stack: SoftwareStack, precision: str, graph=None) -> list[str]:
    """The pins (or a given layout's values) the stack cannot run, each with the rule it breaks."""
    name, problems = stack.name, model_problems(pins, stack, graph)
    for axis in AXES:
        degree = getattr(pins, axis)
        if axis not in stack.parallelism and degree and degree > 1:
            problems.append(f"{axis}={degree}: the {name} stack has no {axis.upper()} parallelism")
    if pins.etp and pins.etp > 1 and "ep" not in stack.parallelism:
        problems.append(f"etp={pins.etp}: the {name} stack has no expert parallelism")
    if pins.zero is not None and pins.zero not in stack.zero_stages:
        problems.append(f"zero={pins.zero}: the {name} stack runs ZeRO stages {list(stack.zero_stages)}")
    elif pins.zero is not None and pins.dp is not None:   # the gradient group is dp x cp
        stages = stack.zero_stages_for(pins.dp * (pins.cp or 1), pins.tp or 1, pins.ep or 1)
        if pins.zero not in stages:
            problems.append(f"zero={pins.zero} with dp={pins.dp} beside tensor or expert parallelism: the {name} "
                            f"stack runs ZeRO stages {list(stages)} there")
    if pins.vp and pins.vp > 1 and not stack.interleaved_schedule and pins.schedule != Schedule.dualpipev:
        problems.append(f"vp={pins.vp}: the {name} stack has no interleaved pipeline schedule")
    problems += _dualpipev_problems(pins, stack, graph) + _even_split_problems(pins, stack, graph)
    if pins.sp and not stack.sequence_parallel:
        problems.append(f"sp=true: the {name} stack has no sequence parallelism")
    if pins.recompute_layers is not None and not stack.per_layer_recompute:
        problems.append(f"recompute_layers={pins.recompute_layers}: the {name} stack recomputes every layer or none")
    if pins.recompute is Recompute.selective and not stack.selective_recompute:
        problems.append(f"recompute=selective: the {name} stack has no selective recomputation")
    unrun = [str(m) for m in pins.recompute_modules or () if str(m) not in stack.recompute_modules]
    if unrun:
        problems.append(f"recompute_modules={'+'.join(unrun)}: the {name} stack recomputes selectively only "
                        f"{', '.join(stack.recompute_modules)}")
    if RecomputeModule.shared_experts in (pins.recompute_modules or ()) and stack.moe_shared_expert_overlap:
        problems.append(f"recompute_modules=shared_experts: the {name} stack runs the shared experts beside the "
                        "all-to-alls (--moe-shared-expert-overlap), which Megatron-Core does not recompute")
    if precision == Precision.fp8 and fp8_recipe_of(pins, stack) is Fp8Recipe.delayed:
        refused = [str(m) for m in pins.recompute_modules or () if m.refused_with_delayed_fp8]
        if refused:
            problems.append(f"recompute_modules={'+'.join(refused)} with fp8_recipe=delayed: Megatron-Core "
                            "recomputes these under FP8 current or block scaling only")
    if pins.dispatcher is not None and pins.dispatcher not in stack.moe_dispatchers:
        problems.append(f"dispatcher={pins.dispatcher}: the {name} stack runs the "
                        f"{', '.join(stack.moe_dispatchers)} MoE dispatcher(s)")
    elif pins.a2a_overlap and pins.dispatcher is not None and pins.dispatcher not in A2A_OVERLAP_DISPATCHERS:
        problems.append(f"a2a_overlap=true with dispatcher={pins.dispatcher}: {A2A_OVERLAP_DISPATCHER_RULE}")
    problems += _tp_overlap_problems(pins, stack) + _offload_problems(pins, stack, graph)
    if pins.a2a_overlap and not stack.moe_a2a_overlap:
        problems.append(f"a2a_overlap=true: the {name} stack has no combined 1F1B (MoE all-to-all overlap; "
                        "Megatron's --overlap-moe-expert-parallel-comm, the CLI's --moe-a2a-overlap)")
    elif pins.a2a_overlap and (refusal := a2a_overlap_refusal(pins.pp, graph)):
        problems.append(f"a2a_overlap=true: {refusal}")
    problems += untrainable_parts(stack, graph)
    if precision == Precision.fp8 and not stack.fp8_recipes:
        problems.append(f"precision=fp8: the {name} stack has no FP8 training")
    elif precision == Precision.fp8 and pins.fp8_recipe is not None and pins.fp8_recipe not in stack.fp8_recipes:
        problems.append(f"fp8_recipe={pins.fp8_recipe}: the {name} stack has {', '.join(stack.fp8_recipes)}")
    return problems


def _dualpipev_problems(pins: Pins, stack: SoftwareStack, graph) -> list[str]:
    """A pinned DualPipeV the stack cannot run: it lacks the schedule, or it lacks it for these degrees."""
    if pins.schedule != Schedule.dualpipev:
        return []
    name = stack.name
    if not stack.dualpipev_schedule:
        return [f"schedule=dualpipev: the {name} stack has no DualPipeV schedule (torch ScheduleDualPipeV, "
                "torchtitan's DualPipeV, MindSpeed's --schedules-method dualpipev)"]
    problems = dualpipev_rules(stack).problems(pins.pp, pins.cp, graph.num_blocks if graph is not None else None, name)
    group = pins.dp * (pins.cp or 1) if pins.dp is not None else None   # the gradient group, where pinned
    if pins.zero is not None and stack.dualpipev_zero_stages is not None \
            and pins.zero not in stack.zero_stages_for(group or 1, 1, 1, dualpipev=True):
        problems.append(f"zero={pins.zero} with schedule=dualpipev{f' and dp x cp = {group}' if group else ''}: "
                        f"the {name} stack runs DualPipeV with ZeRO stages {list(stack.dualpipev_zero_stages)} "
                        "where gradients are reduced over more than one rank, and 0 and 1 over one")
    if not stack.dualpipev_recompute and (pins.recompute not in (None, Recompute.none) or pins.recompute_layers):
        problems.append(f"recompute={pins.recompute or 'full'} with schedule=dualpipev: the {name} stack runs "
                        "DualPipeV without recomputation")
    if stack.dualpipev_weight_pass_recompute and pins.recompute is Recompute.selective:
        problems.append(f"recompute=selective with schedule=dualpipev: {_selective_under_v(name)} (full "
                        "recomputation runs, once more per parameter group in those passes)")
    if pins.a2a_overlap:
        problems.append("a2a_overlap=true with schedule=dualpipev: combined 1F1B is another schedule; DualPipeV's "
                        f"own pairs {'hide' if stack.dualpipev_hides_moe_a2a else 'do not hide'} MoE all-to-alls "
                        f"in the {name} stack")
    return problems


def _even_split_problems(pins: Pins, stack: SoftwareStack, graph=None) -> list[str]:
    """A stack that splits the layers evenly runs only pp x vp dividing them."""
    if not stack.even_pipeline_split or graph is None or not pins.pp or pins.schedule == Schedule.dualpipev:
        return []
    chunks = pins.pp * (pins.vp or 1)
    if splits_evenly(stack.even_pipeline_split, graph.num_blocks, chunks):
        return []
    return [f"pp={pins.pp}" + (f" x vp={pins.vp}" if pins.vp and pins.vp > 1 else "") + f": the {stack.name} "
            f"stack splits the layers evenly over the pipeline chunks, and {graph.name}'s {graph.num_blocks} "
            f"do not divide by {chunks}"]


def dualpipev_rules(stack: SoftwareStack) -> DualPipeVRules:
    return DualPipeVRules(stack.dualpipev_even_split, stack.dualpipev_beside_cp)


def _tp_overlap_problems(pins: Pins, stack: SoftwareStack) -> list[str]:
    """TP communication overlap pinned on where the stack has none, or where the layout has no sequence-parallel
    TP collectives for it (Megatron-Bridge's CommOverlapConfig turns it off without sequence parallelism)."""
    if not pins.tp_overlap:
        return []
    if not stack.tp_comm_overlap:
        return [f"tp_overlap=true: the {stack.name} stack has no TP communication overlap (Megatron --tp-comm-overlap; "
                "the CLI's --tp-comm-overlap states a stack that runs it)"]
    if pins.tp == 1:
        return ["tp_overlap=true with tp=1: there are no tensor-parallel collectives to overlap"]
    if pins.sp is False or not stack.sequence_parallel:
        return ["tp_overlap=true without sequence parallelism: TP overlap's rings gather and scatter the "
                "sequence-parallel activations (Megatron-Bridge's CommOverlapConfig turns it off otherwise)"]
    return []


def _offload_problems(pins: Pins, stack: SoftwareStack, graph=None) -> list[str]:
    """Activation offloading pinned where the stack has none or beside what Megatron-Core's TransformerConfig
    refuses with it (a pipeline, recomputation, as many layers as the model has); beside combined 1F1B, a whole
    layout's rule (`layout_stack_problems`)."""
    count = pins.offload_layers
    if not count:
        return []
    head = f"offload_layers={count}"
    if not stack.activation_offload:
        return [f"{head}: the {stack.name} stack has no activation offloading (Megatron --cpu-offloading-num-layers)"]
    problems = []
    if stack.cuda_graphs:
        problems.append(f"{head}: the {stack.name} stack replays layers as CUDA graphs, which Megatron-Core's "
                        "TransformerConfig refuses beside CPU offloading")
    if pins.pp and pins.pp > 1:
        problems.append(f"{head} with pp={pins.pp}: Megatron-Core offloads activations only without pipeline "
                        "parallelism (TransformerConfig)")
    if pins.recompute not in (None, Recompute.none) or pins.recompute_layers is not None:
        problems.append(f"{head} with recompute={pins.recompute or Recompute.full}: Megatron-Core's CPU offloading "
                        "does not run beside activation recomputation (TransformerConfig)")
    if graph is not None and count >= graph.num_blocks:
        problems.append(f"{head}: Megatron-Core offloads fewer layers than the model's {graph.num_blocks}")
    return problems


def layout_stack_problems(layout: Layout, stack: SoftwareStack, graph=None) -> list[str]:
    """What in a whole layout (its degrees, SP, FP8 recipe, per-layer methods) the stack cannot run, for
    this model where `graph` is given."""
    keys = FULL_KEYS + ("sp", "a2a_overlap", "tp_overlap", "dispatcher", "fp8_recipe", "recompute_modules", "schedule",
                        "recompute_layers", "offload_layers")
    problems = stack_problems(pins_from(values_of(layout, keys)), stack, layout.precision, graph)
    stages = layout.stage_layers
    if layout.dualpipev and stack.dualpipev_even_split and stages and len(set(stages)) > 1:
        problems.append(f"stages {'-'.join(map(str, stages))} with schedule=dualpipev: the {stack.name} stack splits "
                        "the layers evenly over the chunks")
    elif stack.even_pipeline_split and stages and len(set(stages)) > 1:
        problems.append(f"stages {'-'.join(map(str, stages))}: the {stack.name} stack splits the layers evenly "
                        "over the pipeline chunks")
    if layout.offload_layers and stack.hides_moe_a2a(layout):
        problems.append(f"offload_layers={layout.offload_layers} with combined 1F1B: it interleaves two micro-batches' "
                        "layers, and the planner costs offloading as one layer's copies beside the next layer's passes")
    methods = set(layout.layer_recompute or ())
    if len(methods) > 1 and not stack.per_layer_recompute:
        problems.append(f"per-layer recomputation ({', '.join(sorted(map(str, methods)))}): the {stack.name} "
                        "stack recomputes every layer or none")
    if Recompute.selective in methods and not stack.selective_recompute and layout.recompute is not Recompute.selective:
        problems.append(f"recompute=selective: the {stack.name} stack has no selective recomputation")
    elif Recompute.selective in methods and len(methods) > 1 and stack.selective_every_layer:
        problems.append(f"selective recomputation on some layers only: the {stack.name} stack recomputes "
                        "selectively every layer or none (one recompute granularity for the model)")
    if Recompute.selective in methods and layout.dualpipev and stack.dualpipev_weight_pass_recompute \
            and layout.recompute is not Recompute.selective:   # a whole-layout selective is said by the pins
        problems.append("selective recomputation on some layers with schedule=dualpipev: "
                        + _selective_under_v(stack.name))
    return problems


def stack_pins(pins: Pins, stack: SoftwareStack, graph=None) -> Pins:
    """The user's pins with what the stack lacks (for this model) ruled out and its defaults filled (call
    after `stack_problems` found nothing)."""
    fixed = {axis: 1 for axis in AXES if getattr(pins, axis) is None and (
        axis not in stack.parallelism or model_problems(replace(pins, **{axis: 2}), stack, graph))}
    if pins.etp is None and ("ep" not in stack.parallelism or model_problems(replace(pins, etp=2), stack, graph)):
        fixed["etp"] = 1
    if not stack.interleaved_schedule and not stack.dualpipev_schedule and pins.vp is None:
        fixed["vp"] = 1
    if pins.offload_layers:   # offloading runs at pp = 1, without recomputation or combined 1F1B
        fixed.update({key: value for key, value in (("pp", 1), ("recompute", Recompute.none), ("a2a_overlap", False))
                      if getattr(pins, key) is None})
    fixed.update(stack_filled(pins, stack))
    dualpipev = dualpipev_rules(stack) if stack.dualpipev_schedule else None
    return replace(pins, zero_stages=stack.zero_stages, dualpipev=dualpipev,
                   interleaved_schedule=stack.interleaved_schedule,
                   even_pipeline_split=stack.even_pipeline_split, **fixed)


def stack_filled(pins: Pins, stack: SoftwareStack) -> dict:
    """The stack's defaults (`LayoutField.stack_default`) of the fields the search does not choose and the
    pins leave open: gradient dtype, FP8 recipe, and no SP where the stack has none."""
    filled = {}
    for key, declared in FIELDS.items():
        default = declared.field.stack_default
        if default is None or declared.field.searched or getattr(pins, key) is not None:
            continue
        value = default(stack)
        if value is not None:
            filled[key] = declared.field.domain.from_value(key, value)
    return filled


def recompute_choices(pins: Pins, stack: SoftwareStack) -> tuple[Recompute, ...]:
    """Recomputation methods the search may give a layer."""
    if pins.recompute_layers is not None:   # the first N blocks of each chunk fully, the others not at all
        return (Recompute.none, Recompute.full)
    if pins.recompute is not None:
        return (pins.recompute,)
    return tuple(r for r in Recompute if r is not Recompute.selective or stack.selective_recompute)


def _selective_under_v(name: str) -> str:
    """Why a stack whose DualPipeV splits the weight pass over non-reentrant checkpointing refuses selective."""
    return (f"the {name} stack's selective checkpointing allows one backward per region, and DualPipeV's split "
            "weight pass runs a second")


def leaf_recompute_methods(stack: SoftwareStack, layout: Layout,
                           allowed: tuple[Recompute, ...]) -> tuple[Recompute, ...]:
    """The methods a whole layout's layers may take, of `allowed`: none fully where the stack hides its MoE
    all-to-alls (Megatron-Core refuses the pair beside full recomputation, so the costs' overlap stays true),
    and only no recomputation inside a DualPipeV the stack cannot recompute in (no selective one where its split
    weight pass would run selective checkpointing twice)."""
    if layout.dualpipev and not stack.dualpipev_recompute:
        return tuple(r for r in allowed if r is Recompute.none)
    if layout.dualpipev and stack.dualpipev_weight_pass_recompute:
        return tuple(r for r in allowed if r is not Recompute.selective)
    if stack.hides_moe_a2a(layout):
        return tuple(r for r in allowed if r is not Recompute.full)
    return allowed


def fp8_recipe_of(pins: Pins, stack: SoftwareStack) -> Fp8Recipe | None:
    """The FP8 recipe a search with these pins runs: the pinned one, else the stack's first (not searched)."""
    if pins.fp8_recipe is not None:
        return pins.fp8_recipe
    return Fp8Recipe(stack.fp8_recipes[0]) if stack.fp8_recipes else None


def module_choices(pins: Pins, stack: SoftwareStack, graph, precision: str) -> tuple[RecomputeModule, ...]:
    """The modules the search may have selective recomputation repeat, chosen with each partition: those
    the stack can recompute and the model has, where neither the modules nor the method are pinned (a
    pinned recompute=selective alone means Megatron-Core's default, core_attn). Empty: the layout's set."""
    if pins.recompute_modules is not None or pins.recompute is not None or not stack.selective_recompute:
        return ()
    delayed_fp8 = precision == Precision.fp8 and fp8_recipe_of(pins, stack) is Fp8Recipe.delayed
    choices = tuple(m for m in graph.recompute_modules if m.value in stack.recompute_modules
                    and not (delayed_fp8 and m.refused_with_delayed_fp8)
                    and not (m is RecomputeModule.shared_experts and stack.moe_shared_expert_overlap))
    return choices if len(choices) > 1 else ()


def uniform_recompute(pins: Pins, stack: SoftwareStack) -> bool:
    """Every layer must take the same method: the stack checkpoints all layers or none."""
    return pins.recompute is None and not stack.per_layer_recompute
