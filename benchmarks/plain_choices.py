"""Published runs that ran the framework settings the plain path chooses, predicted through the plain path: never
fitted (outside shared/validation, or, for the one row inside it, a row whose precision is unstated and so
counted in no figure).

The plain path's MoE errors over shared/validation (docs/accuracy-plain.md) compare its prediction of its own
choices (a DeepEP-style dispatcher, combined 1F1B) with rows whose recipes ran others (NCCL's all-to-all, no
overlap). These runs measured those choices: each is predicted as `benchmarks/plain_path.py` predicts a row, from
its published degrees, batch, sequence and precision and the stack by name, and the table says what the search
chose beside what the run ran.
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.published import DEFAULT_FAMILY_STACK, FAMILY_STACKS, load_runs, run_family

SUMMARY = "docs/performance-summary.md, NVIDIA-NeMo/Megatron-Bridge 067f987d"


@dataclass(frozen=True)
class ChoiceMeasurement:
    """One published run of a model in shared/validation (`model_of`, whose model and devices it shares)."""
    model_of: str
    source: str
    degrees: str               # the published degrees, as the plain path takes them
    precision: str
    ran: str                   # the dispatcher and overlap it ran, and what else it ran the model does not bill
    global_batch: int | None = None       # None: the shared row's
    measured_step_s: float | None = None  # None: the shared row's
    mtp_layers: int | None = None   # where its model trains MTP modules the shared row's does not

    def measured_s(self, run) -> float:
        return run.measured_step_s if self.measured_step_s is None else self.measured_step_s


CHOICES_MEASURED = [
    # 26.08 table, DGX-GB200, 256 GPUs, MXFP8, GBS 4096, MBS 1, seq 4096, TP1 PP4 VP4 EP64: 4,912 tokens/s per GPU,
    # 4096 x 4096 / (4912 x 256) = 13.343 s. Its recipe (perf_recipes/deepseek/gb200/deepseek_v3.py
    # deepseek_v3_pretrain_256gpu_gb200_fp8mx_config, _enable_deepseek_full_iteration_mxfp8 in common.py): HybridEP,
    # overlap_moe_expert_parallel_comm and delay_wgrad_compute on, full-iteration CUDA graphs; its layout carries the
    # recipe's MTP module (recipes/deepseek/h100/deepseek_v3.py set_deepseek_v3_pipeline_model_parallel_layout)
    ChoiceMeasurement("mbridge-25p11-gb200-deepseekv3-mxfp8-256gpu-wo-mtp",
                      f"Megatron-Bridge's 26.08 table ({SUMMARY}) and its recipe", "tp=1,pp=4,vp=4,cp=1,ep=64,mbs=1",
                      "fp8", "HybridEP, combined 1F1B; not billed: full-iteration CUDA graphs, paged stash, fused "
                      "grouped MLP", 4096, 4096 * 4096 / (4912 * 256), mtp_layers=1),
    # 26.08 table, DGX-GB200, 256 GPUs, MXFP8, GBS 8192, MBS 1, TP1 PP8 VP3 EP32: 7,280 tokens/s per GPU,
    # 8192 x 4096 / (7280 x 256) = 18.004 s. Its recipe (perf_recipes/qwen/gb200/qwen3_moe.py
    # qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config, _enable_hybridep_full_iteration_mxfp8 in qwen/common.py):
    # HybridEP, overlap_moe_expert_parallel_comm and delay_wgrad_compute on, full-iteration CUDA graphs
    ChoiceMeasurement("mbridge-25p11-gb200-qwen3-235b-a22b-bf16-256gpu",
                      f"Megatron-Bridge's 26.08 table ({SUMMARY}) and its recipe", "tp=1,pp=8,vp=3,cp=1,ep=32,mbs=1",
                      "fp8", "HybridEP, combined 1F1B; not billed: full-iteration CUDA graphs, paged stash, fused "
                      "grouped MLP", 8192, 8192 * 4096 / (7280 * 256)),
    # skills/nemo-mbridge-perf-expert-parallel-overlap/SKILL.md 'HybridEP Production-Shape Benchmark' @067f987d: BF16,
    # seq 4096, TP1 PP1 CP1 EP16, MBS 1, GBS 1024, HybridEP, overlap on (its independent validation run)
    ChoiceMeasurement("mbridge-25p11-h100-qwen3-30b-a3b-fp8-16gpu",
                      "Megatron-Bridge's HybridEP overlap benchmark (skills/nemo-mbridge-perf-expert-parallel-overlap, "
                      "067f987d)", "tp=1,pp=1,cp=1,ep=16,mbs=1", "bf16",
                      "HybridEP, combined 1F1B without delayed weight gradients; not billed: TE CUDA graphs of the "
                      "router and the dispatcher's preprocessing", 1024, 20.992),
    # the runs file's row, 25.09 table: DeepSeek-V3 on 1,024 H100, precision not stated (so in no figure),
    # launched with DeepEP and combined 1F1B (benchmarks/published.py RUN_STACK_SETTINGS)
    *(ChoiceMeasurement("mbridge-25p09-h100-deepseekv3-prec-na-1024gpu",
                        f"the runs file's 25.09 row, precision not stated (predicted in {precision})",
                        "tp=2,pp=8,vp=4,cp=1,ep=64,mbs=1", precision, "DeepEP, combined 1F1B")
      for precision in ("bf16", "fp8")),
]


def shared_runs() -> dict:
    """The runs file's rows by id, those of unstated precision included (read as BF16: each entry states its own)."""
    found, _ = load_runs()
    unstated, _ = load_runs(unstated_precision="bf16")
    return {run.id: run for run in [*found, *unstated]}


def plain_choice(entry: ChoiceMeasurement, runs: dict, time_limit_s: float):
    """The plain path's plan for the run at its published degrees: (plan, the shared row it takes model and devices
    from)."""
    from planner.api import evaluate
    run = runs[entry.model_of]
    model = run.model if entry.mtp_layers is None else run.model.model_copy(update={"mtp_layers": entry.mtp_layers})
    stack = FAMILY_STACKS.get(run_family(run.id), DEFAULT_FAMILY_STACK)
    cluster = run.cluster.model_copy(update={"segment_devices": None})
    batch = run.global_batch if entry.global_batch is None else entry.global_batch
    return evaluate(model, cluster, entry.degrees, global_batch=batch, seq_len=run.seq_len,
                    precision=entry.precision, stack=stack, time_limit_s=time_limit_s), run
