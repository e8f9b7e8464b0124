"""A forward and another micro-batch's backward run layer by layer on two CUDA streams, as Megatron-Core's
combined 1F1B runs them (MoE all-to-all overlap): compute on one stream, the expert all-to-alls on the other.

Megatron-Core `TransformerLayerSchedulePlan.run` (megatron/core/models/common/model_chunk_schedule_plan.py,
NVIDIA/Megatron-LM d98e8a64) issues one layer's forward f and another layer's backward b as

    comm stream: combine_bwd(b)   | dispatch_fwd(f), dispatch_bwd(b)        | combine_fwd(f)
    comp stream: pre_dispatch(f)  | mlp_bwd(b), [mlp_dw(b)], mlp_fwd(f)     | pre_dispatch_bwd(b), [its dw]

where pre_dispatch is attention, the pre-MLP norm, shared experts, router and permutation, and mlp the routed
experts between dispatch and combine (megatron/core/models/gpt/fine_grained_callables.py). Each node waits on
its micro-batch's event, which the previous node of that micro-batch recorded; weight gradients delayed by
--delay-wgrad-compute record none, so they run beside the dispatch backward instead of before it.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class StreamTask:
    """One kernel group on one stream: `seconds` of work at full speed, after the tasks named in `after`
    (and after the task before it on its stream)."""
    name: str
    stream: str
    seconds: float
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerPassParts:
    """One layer's pass for one micro-batch, split where Megatron's combined 1F1B splits it. Forward: the
    `*_weight_s` are 0. Backward: `*_s` computes input gradients, `*_weight_s` weight gradients."""
    pre_dispatch_s: float          # attention, pre-MLP norm, shared experts, router, permutation
    pre_dispatch_weight_s: float
    experts_s: float               # the routed experts and the dispatcher's sorts
    experts_weight_s: float
    dispatch_s: float              # the all-to-all that sends tokens to their experts (its gradient's, backward)
    combine_s: float               # the one that brings them back

    @property
    def compute_s(self) -> float:
        return self.pre_dispatch_s + self.pre_dispatch_weight_s + self.experts_s + self.experts_weight_s


def two_stream_seconds(tasks: list[StreamTask], held_share: float, comm_rate: float = 1.0) -> float:
    """When the last task ends. Each stream runs its tasks in list order, each once those it waits on have
    ended; while both streams run, a compute task runs at (1 - held_share) of full speed, the SMs the comm
    kernels hold (DeepSeek-V3 3.2.2), and a comm task at `comm_rate` (what a profile of the two streams measured:
    `Device.flex_dispatch_rate_beside_compute`); each alone at full speed."""
    queues = {s: [t for t in tasks if t.stream == s] for s in (COMPUTE, COMM)}
    done: set[str] = set()
    running: dict[str, tuple[StreamTask, float]] = {}   # stream -> (task, seconds of work left)
    now = 0.0
    while True:
        started = True
        while started:   # start what may start; an empty task ends at once and may free the other stream
            started = False
            for stream, queue in queues.items():
                if stream not in running and queue and all(a in done for a in queue[0].after):
                    task, started = queue.pop(0), True
                    if task.seconds > 0:
                        running[stream] = (task, task.seconds)
                    else:
                        done.add(task.name)
        if not running:
            if any(queues.values()):
                raise ValueError(f"stream tasks wait on each other: {[q[0].name for q in queues.values() if q]}")
            return now
        both = len(running) == 2
        rates = {COMPUTE: 1 - held_share if both else 1.0, COMM: comm_rate if both else 1.0}
        step = min(left / rates[s] for s, (_, left) in running.items())
        now += step
        for stream, (task, left) in list(running.items()):
            left -= step * rates[stream]
            if left <= 1e-15 * task.seconds:
                del running[stream]
                done.add(task.name)
            else:
                running[stream] = (task, left)


def combined_1f1b_tasks(forward: LayerPassParts, backward: LayerPassParts, layers: int,
                        delay_wgrad: bool) -> list[StreamTask]:
    """`layers` layer pairs of one model chunk in Megatron-Core's issue order (module docstring): the
    forward of layer i beside the backward of layer n-1-i, every layer alike."""
    tasks: list[StreamTask] = []
    last_f = last_b = ()
    for i in range(layers):
        def name(part: str) -> str:
            return f"{part}[{i}]"
        mlp_bwd = backward.experts_s + (0.0 if delay_wgrad else backward.experts_weight_s)
        attn_bwd = backward.pre_dispatch_s + (0.0 if delay_wgrad else backward.pre_dispatch_weight_s)
        tasks += [
            StreamTask(name("combine_bwd"), COMM, backward.dispatch_s, last_b),     # the combine's gradient
            StreamTask(name("pre_dispatch_fwd"), COMPUTE, forward.pre_dispatch_s, last_f),
            StreamTask(name("mlp_bwd"), COMPUTE, mlp_bwd, (name("combine_bwd"),)),
            StreamTask(name("dispatch_fwd"), COMM, forward.dispatch_s, (name("pre_dispatch_fwd"),)),
            StreamTask(name("mlp_dw"), COMPUTE, backward.experts_weight_s if delay_wgrad else 0.0),
            StreamTask(name("dispatch_bwd"), COMM, backward.combine_s, (name("mlp_bwd"),)),
            StreamTask(name("mlp_fwd"), COMPUTE, forward.experts_s, (name("dispatch_fwd"),)),
            StreamTask(name("combine_fwd"), COMM, forward.combine_s, (name("mlp_fwd"),)),
            StreamTask(name("pre_dispatch_bwd"), COMPUTE, attn_bwd, (name("dispatch_bwd"),)),
            StreamTask(name("pre_dispatch_dw"), COMPUTE, backward.pre_dispatch_weight_s if delay_wgrad else 0.0),
        ]
        last_f, last_b = (name("combine_fwd"),), (name("pre_dispatch_bwd"),)
    return tasks


# identical layer pairs settle into a steady state where each adds the same time (both chains start every pair
# at the same offsets; the random passes of tests/test_paired_passes.py settle after the first pair, and it
# checks this rule against the whole run, 1-40 layers, to 1e-9): a chunk of many layers is its first
# STEADY_FROM pairs and that increment
STEADY_FROM = 3


def combined_1f1b_exposed_s(forward: LayerPassParts, backward: LayerPassParts, layers: int, held_share: float,
                            delay_wgrad: bool, comm_rate: float = 1.0) -> float:
    """Seconds per layer pair beyond the two passes' compute when combined 1F1B pairs them: the all-to-alls
    that outlast what runs beside them, the waits the order makes, the compute slowed by the held SMs and the
    all-to-alls by what runs beside them."""
    def run(pairs: int) -> float:
        return two_stream_seconds(combined_1f1b_tasks(forward, backward, pairs, delay_wgrad), held_share, comm_rate)
    if layers <= STEADY_FROM + 1:
        total = run(layers)
    else:
        settled, one_more = run(STEADY_FROM), run(STEADY_FROM + 1)
        total = settled + (layers - STEADY_FROM) * (one_more - settled)
    return total / layers - forward.compute_s - backward.compute_s


def combined_1f1b_exposed_floor_s(forward: LayerPassParts, backward: LayerPassParts, held_share: float,
                                  comm_rate: float = 1.0) -> float:
    """At or below `combined_1f1b_exposed_s` for any number of layers, without running the streams: a pair's
    all-to-alls A = both passes' dispatch and combine, its compute W, the comm at rate r beside compute that holds
    share h. With O the time both streams run and C the comm alone, A = r O + C and W = compute alone + (1 - h) O,
    so the pair takes at least compute alone + O + C = W + A - (r - h) O; O is at most W / (1 - h) (the compute
    lasts no longer) and A / r (nor the comm). Its exposure (beyond W) is at least A - (r - h) min(W / (1 - h), A / r)
    where r > h, else A (at r = 1: max(A - W, h A))."""
    comm = forward.dispatch_s + forward.combine_s + backward.dispatch_s + backward.combine_s
    if comm_rate <= held_share:
        return comm
    compute = forward.compute_s + backward.compute_s
    both_run_s = min(compute / (1 - held_share), comm / comm_rate)
    return max(comm - (comm_rate - held_share) * both_run_s, 0.0)
