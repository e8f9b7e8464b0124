"""Published training runs (shared/validation/published_runs.yaml) as model, cluster and layout inputs."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from cost_models.layout import Layout, OverlapModel, Recompute
from cost_models.layout_codec import LAYOUT_KEYS, layout_from, parse_values
from hardware_profiles.loader import cluster_from_device, list_devices
from hardware_profiles.schema import Cluster

from planner.capture.model_config import MLAConfig, ModelConfig, MoEConfig

DEFAULT_RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "validation" / "published_runs.yaml"
MOE_FIELDS = {"shared_experts": "num_shared_experts"}   # the runs file's names -> ModelConfig's
LAYOUT_FIELDS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vp": "vp", "micro_batch": "mbs"}


@dataclass(frozen=True)
class SoftwareStack:
    """What the run's software could do, which the rows leave implicit."""
    flash_attention: bool      # FlashAttention (Dao et al., May 2022) in the stack
    sequence_parallel: bool    # Megatron sequence parallelism (Korthikanti et al., May 2022) available
    per_layer_recompute: bool  # selective / per-layer recomputation; else all layers checkpoint or none do
    tp_comm_overlap: bool      # TP collectives overlapped with GEMMs (NeMo recipes: ub_tp_comm_overlap)
    grad_reduce: str = "fp32"  # gradient buffers and reductions
    fp8_recipe: str = "delayed"  # FP8 scaling (Megatron --fp8-recipe), where the run is FP8


# By source family (run id prefix). Megatron-LM and Megatron-DeepSpeed runs of 2021-22 (SC21, MT-NLG on
# Selene, BLOOM, Korthikanti et al.) materialised the attention matrix; only Korthikanti et al. had sequence
# parallelism and selective recomputation (their rows say where they used them); before them activation
# checkpointing was one switch for every layer (--checkpoint-activations). NeMo, Megatron-Core and
# Megatron-Bridge runs have all of it, and their recipes overlap TP communication with GEMMs
# (NeMo-Framework-Launcher conf/training gpt3/20b.yaml, gpt3/175b.yaml, llama/llama3_1_70b.yaml:
# ub_tp_comm_overlap: true).
CURRENT_STACK = SoftwareStack(flash_attention=True, sequence_parallel=True, per_layer_recompute=True,
                              tp_comm_overlap=True)
LEGACY = SoftwareStack(flash_attention=False, sequence_parallel=False, per_layer_recompute=False,
                       tp_comm_overlap=False)
STACKS = {"narayanan21": LEGACY, "mtnlg": LEGACY, "bloom": LEGACY, "opt": LEGACY,
          "korthikanti22": replace(LEGACY, sequence_parallel=True, per_layer_recompute=True),
          # Megatron-Bridge's performance scripts reduce gradients in bf16 (set_llama3_common_configs and
          # set_qwen3_common_configs: grad_reduce_in_fp32 = False); its 25.11 FP8 rows are labelled FP8-CS
          # (current scaling: Megatron's tensorwise recipe)
          "mbridge": replace(CURRENT_STACK, grad_reduce="bf16", fp8_recipe="tensorwise")}


# Per-run settings read in the recipe a run used, where they depart from its family's stack
RECIPE_SETTINGS = {
    # NeMo-Framework-Launcher conf/training/nemotron/nemotron_340b.yaml: optim mcore_distributed_optim,
    # grad_sync_dtype: bf16 (the family's other recipes use distributed_fused_adam without it)
    "nemo2407-nemotron-340b-128gpu": {"grad_reduce": "bf16"},
}


def software_stack(run_id: str) -> SoftwareStack:
    stack = STACKS.get(run_id.split("-")[0], CURRENT_STACK)
    return replace(stack, **RECIPE_SETTINGS.get(run_id, {}))


def run_overlap(run_id: str) -> OverlapModel:
    """What the run's runtime overlapped: every prediction of the run (search, calibration) uses it."""
    return OverlapModel(tp_comm_overlap=software_stack(run_id).tp_comm_overlap)


@dataclass(frozen=True)
class PublishedRun:
    id: str
    model: ModelConfig
    cluster: Cluster
    global_batch: int
    seq_len: int
    known: dict                 # layout fields the source gives (planner.plan pins)
    measured_step_s: float
    measured_field: str         # which measurement the step time comes from
    evidence: str
    flops_convention: str
    precision: str              # bf16 unless the row says fp8


def _model(run: dict) -> ModelConfig:
    m = run["model"]
    activation = m.get("activation") or "gelu"
    gpt = activation == "gelu"
    stack = software_stack(run["id"])
    moe = m.get("moe")
    mla = m.get("mla")
    heads = m["num_attention_heads"]
    return ModelConfig(
        name=run["id"], num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=heads,
        num_query_groups=m.get("num_query_groups") or heads, head_dim=m.get("head_dim"),
        ffn_hidden_size=m.get("ffn_hidden_size") or 4 * m["hidden_size"], vocab_size=m.get("vocab_size") or 51200,
        seq_length=m["seq_length"], activation=activation, normalization="layernorm" if gpt else "rmsnorm",
        position_embedding="learned" if gpt else "rope",
        tied_embeddings=gpt if m.get("tied_embeddings") is None else bool(m["tied_embeddings"]),
        attention="mla" if mla else ("mha" if (m.get("num_query_groups") or heads) == heads else "gqa"),
        attention_impl="flash" if stack.flash_attention else "math",
        add_bias=gpt, mla=MLAConfig(**mla) if mla else None,
        moe=MoEConfig(**{MOE_FIELDS.get(k, k): v for k, v in moe.items() if v is not None}) if moe else None)


def _step_time(run: dict, gbs: int, seq: int) -> tuple[float | None, str]:
    measured = run["measured"]
    if measured.get("step_time_s"):
        return float(measured["step_time_s"]), "step_time_s"
    per_device = measured.get("tokens_per_s_per_device")
    if per_device:
        return gbs * seq / (per_device * run["hardware"]["num_devices"]), "tokens_per_s_per_device"
    return None, ""


def load_runs(path: Path | str = DEFAULT_RUNS) -> tuple[list[PublishedRun], list[tuple[str, str]]]:
    """Runs that can be predicted, and (id, why not) for the rest."""
    runs, skipped = [], []
    for run in yaml.safe_load(Path(path).read_text()):
        layout, hardware, stack = run["layout"], run["hardware"], software_stack(run["id"])
        gbs = layout.get("global_batch")
        if not gbs:
            skipped.append((run["id"], "no global batch"))
            continue
        if hardware["device"] not in list_devices():
            skipped.append((run["id"], f"device {hardware['device']} has no profile"))
            continue
        seq = run["model"]["seq_length"]
        step, field = _step_time(run, gbs, seq)
        if step is None:
            skipped.append((run["id"], "no measured step time or throughput"))
            continue
        try:
            model = _model(run)
        except Exception as exc:  # an incomplete model row
            skipped.append((run["id"], f"model incomplete: {str(exc).splitlines()[0]}"))
            continue
        known = {key: layout[src] for src, key in LAYOUT_FIELDS.items() if layout.get(src) is not None}
        if layout.get("recompute"):
            known["recompute"] = layout["recompute"]
        if isinstance(layout.get("zero"), int):
            known["zero"] = layout["zero"]
        if layout.get("sequence_parallel") is not None:
            known["sp"] = bool(layout["sequence_parallel"])
        elif not stack.sequence_parallel:
            known["sp"] = False
        if stack.grad_reduce != "fp32":
            known["grad_reduce"] = stack.grad_reduce
        if stack.fp8_recipe != "delayed":
            known["fp8_recipe"] = stack.fp8_recipe
        cluster = cluster_from_device(hardware["device"], hardware["num_devices"], hardware.get("devices_per_node"))
        precision = "fp8" if layout.get("precision") == "fp8" else "bf16"
        runs.append(PublishedRun(run["id"], model, cluster, gbs, seq, known, step, field, run.get("evidence", ""),
                                 run["measured"].get("flops_convention", ""), precision))
    return runs, skipped


def published_layout(run: PublishedRun, precision: str) -> Layout | None:
    """The run's layout when the source gives every degree (zero and recompute default to Megatron's)."""
    need = ("tp", "pp", "dp", "cp")
    if not all(k in run.known for k in need) or "mbs" not in run.known:
        return None
    known = {key: value for key, value in run.known.items() if key in LAYOUT_KEYS}
    defaults = {"recompute": "none"}
    return layout_from(parse_values({**defaults, **known}, run.id), global_batch=run.global_batch,
                       precision=precision)


def predict(run: PublishedRun, time_limit_s: float = 20.0):
    """The planner's best plan for the run's published layout, unknown fields searched as the run's
    software allows: where it checkpoints all layers or none, both are tried and the faster that fits wins."""
    from planner.api import InfeasibleError, plan
    stack = software_stack(run.id)
    base = dict(global_batch=run.global_batch, seq_len=run.seq_len, precision=run.precision,
                time_limit_s=time_limit_s, top_k=1, overlap=run_overlap(run.id))
    if "recompute" in run.known or stack.per_layer_recompute:
        return plan(run.model, run.cluster, **base, **run.known)
    best, failure = None, None
    for recompute in ("none", "full"):
        try:
            result = plan(run.model, run.cluster, **base, **run.known, recompute=recompute)
        except InfeasibleError as exc:
            failure = exc
            continue
        if best is None or result.step_time_s < best.step_time_s:
            best = result
    if best is None:
        raise failure
    return best
