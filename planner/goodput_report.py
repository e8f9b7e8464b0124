"""Goodput of a plan: the reliability model (cost_models/reliability.py) fed with what the plan says about a
step (its time, each rank's parameter bytes, whether replicas exist to compare, what checking its matrix
products adds) and the recovery settings the user runs with (`--recovery timeout=300,spares=yes,elastic=no,
sdc_every=10,gemm_every=auto,sdc_seen=1,opt_every=auto,opt_seen=1,spikes_per_day=0`)."""
from __future__ import annotations

from dataclasses import replace

from cost_models.communication import Collective, collective_time
from cost_models.compute import ShardSpec, memory_seconds, product_check_seconds
from cost_models.reliability import Goodput, Recovery, StepContext, goodput
from hardware_profiles.errors import UserInputError
from hardware_profiles.schema import Cluster
from hardware_profiles.topology import MeshDim, place_dims_together

from .job import Job
from .plans import Plan

RECOVERY_FIELDS = {"timeout": "collective_timeout_s", "spares": "spare_nodes", "elastic": "elastic",
                   "sdc_every": "sdc_check_every_steps", "spikes_per_day": "loss_spikes_per_day",
                   "gemm_every": "product_check_every_steps", "sdc_seen": "sdc_seen_per_check",
                   "opt_every": "optimizer_check_every_steps", "opt_seen": "optimizer_seen_per_check",
                   "opt_share": "optimizer_sdc_share"}
EXPECTED = "comma-separated key=value with keys timeout (s), spares (yes/no), elastic (yes/no), sdc_every " \
           "(steps, 0 for none), gemm_every (steps, 0 for none, auto), sdc_seen (0 to 1), opt_every (steps, 0 " \
           "for none, auto), opt_seen (0 to 1), opt_share (0 to 1), spikes_per_day"
CHECKED_STEPS = ("sdc_every", "gemm_every", "opt_every")   # whole steps
SEEN = ("sdc_seen", "opt_seen")                            # chances, above 0
# runtime/optimizer_check.py, per owned tensor: parameter, gradient and AdamW's two moments sampled before and
# after the update, each an index and a copy to the host; then one fresh optimizer step on the host per check
SAMPLED_KEYS = 4
OPS_PER_KEY = 2
RECOMPUTE_CALLS = 10
SAMPLE_BYTES = 4   # fp32 values exchanged


# what a recovery setting can be: a collective timeout up to a day, a check at most every 10^6 steps, spikes at
# most one a second; past these the goodput model's exponentials leave floating point
RECOVERY_LIMITS = {"timeout": 86_400.0, "sdc_every": 1_000_000, "spikes_per_day": 86_400.0,
                   "gemm_every": 1_000_000, "sdc_seen": 1.0, "opt_every": 1_000_000, "opt_seen": 1.0,
                   "opt_share": 1.0}


def parse_recovery(text: str | None, field: str = "--recovery") -> Recovery:
    recovery, seen = Recovery(), set()
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in RECOVERY_FIELDS:
            raise UserInputError(f"'{item}'", field=field, expected=EXPECTED)
        if key in seen:
            raise UserInputError(f"'{key}' is given twice", field=field, expected="each key at most once")
        seen.add(key)
        recovery = replace(recovery, **{RECOVERY_FIELDS[key]: _value(key, value, item, field)})
    return recovery


def _value(key: str, text: str, item: str, field: str):
    if key in ("spares", "elastic"):
        if text not in ("yes", "no"):
            raise UserInputError(f"'{item}'", field=field, expected=f"{key}: yes or no")
        return text == "yes"
    if key in ("gemm_every", "opt_every") and text == "auto":
        return None   # the goodput model chooses
    try:
        number = int(text) if key in CHECKED_STEPS else float(text)
    except ValueError:
        raise UserInputError(f"'{item}'", field=field, expected=EXPECTED) from None
    if not 0 <= number <= RECOVERY_LIMITS[key] or (key in SEEN and number == 0):   # nan and inf fail too
        low = "above 0" if key in SEEN else "from 0"
        raise UserInputError(f"'{item}'", field=field, expected=f"{key} {low} to {RECOVERY_LIMITS[key]:,g}")
    return number


def step_context(plan: Plan, cluster: Cluster, job: Job | None = None) -> StepContext:
    """One replica check reads the rank's parameters once at the device's sustained memory bandwidth; a step
    whose products are checked adds their checksums' traffic (the stage's blocks, every micro-batch: no job,
    no product checks priced)."""
    weights = max(record.parts.get("weights", 0.0) for record in plan.memory) if plan.memory else 0.0
    return StepContext(step_s=plan.step_time_s, check_s=memory_seconds(cluster.device, weights),
                       replicated=plan.layout.zero < 3,
                       product_check_s=product_check_s(plan, cluster, job) if job else 0.0,
                       optimizer_check_s=optimizer_check_s(plan, cluster, job) if job else 0.0,
                       optimizer_share=plan.breakdown.get("optimizer_s", 0.0) / plan.step_time_s,
                       sharded_update=plan.layout.zero >= 1)


def product_check_s(plan: Plan, cluster: Cluster, job: Job) -> float:
    layout = plan.to_layout()
    spec = ShardSpec.of(layout, job.stack, ep_imbalance=job.ep_imbalance)
    per_micro_batch = sum(count * product_check_seconds(kind, cluster.device, spec)
                          for kind, count in job.graph.costs().block_counts)
    return per_micro_batch * layout.num_micro_batches / layout.pp


def optimizer_check_s(plan: Plan, cluster: Cluster, job: Job, recovery: Recovery = Recovery()) -> float:
    """What checking a sample of a rank's optimizer update adds (runtime/optimizer_check.py): per tensor it owns
    (ZeRO-1: whole tensors dealt out over the data-parallel ranks; ZeRO-2/3: a shard of each of its stage's),
    small ops issued from Python at the device's host call time (one kernel's floor where the node's CPU was not
    measured), a host recomputation, and one small all-gather of the samples over the data-parallel group."""
    layout = plan.to_layout()
    if layout.zero < 1 or layout.dp < 2:
        return 0.0
    stage = sum(count * sum(1 for op in kind.ops if op.weight_bytes > 0)
                for kind, count in job.graph.costs().block_counts) / layout.pp
    owned = stage / layout.dp if layout.zero == 1 else stage
    device = cluster.device
    call_s = (device.host_call_us or device.gemm.kernel_floor_us) * 1e-6
    issued_s = (owned * SAMPLED_KEYS * OPS_PER_KEY * 2 + RECOMPUTE_CALLS) * call_s
    samples = owned * recovery.optimizer_samples * SAMPLED_KEYS * 2 * SAMPLE_BYTES
    dims = tuple(MeshDim(name, size) for name, size in layout.mesh_dims())
    group = place_dims_together("dp", ("dp",), dims, cluster)
    return issued_s + collective_time(Collective.all_gather, samples * layout.dp, group, cluster).seconds


def plan_goodput(plan: Plan, cluster: Cluster, total_params: float, recovery: Recovery | None = None,
                 job: Job | None = None) -> Goodput:
    return goodput(cluster, plan.num_devices, total_params, plan.mfu, recovery=recovery,
                   context=step_context(plan, cluster, job))


def goodput_summary(result: Goodput) -> dict:
    """What `planner plan --objective goodput` reports (JSON and table)."""
    return {"ettr": result.ettr, "goodput": result.goodput, "mtbf_h": result.mtbf_s / 3600,
            "interruptions_per_day": result.interruptions_per_day,
            "checkpoint_interval_min": result.interval_s / 60, "checkpoint_bytes": result.checkpoint_bytes,
            "checkpoint_save_s": result.checkpoint_save_s, "checkpoint_blocking_s": result.checkpoint_blocking_s,
            "restart_s": result.restart_s, "lost_s_per_day": dict(result.lost_s_per_day),
            "product_check_every_steps": result.recovery.product_check_every_steps,
            "optimizer_check_every_steps": result.recovery.optimizer_check_every_steps,
            "notes": list(result.notes)}
