"""Published training runs (shared/validation/published_runs.yaml) as model, cluster and layout inputs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from cost_models.layout_codec import LAYOUT_KEYS
from hardware_profiles.loader import cluster_from_device, list_devices, load_device, load_stack
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from planner.job import resolve_cluster
from planner.graph_capture.model_config import MLAConfig, ModelConfig, MoEConfig

DEFAULT_RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "validation" / "published_runs.yaml"
MOE_FIELDS = {"shared_experts": "num_shared_experts"}   # the runs file's names -> ModelConfig's
LAYOUT_FIELDS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "vp": "vp", "micro_batch": "mbs"}


# By source family (run id prefix): the built-in software stack the runs used (hardware_profiles/stacks),
# and stack fields a family's runs set otherwise. Megatron-LM and Megatron-DeepSpeed runs of 2021 (SC21,
# MT-NLG on Selene, BLOOM) checkpointed all layers or none and materialised attention; Korthikanti et al.
# added sequence parallelism and selective recomputation; NeMo and Megatron-Bridge recipes overlap TP
# communication (ub_tp_comm_overlap / tp_comm_overlap).
# A longer id prefix wins: dgxc-benchmarking's 25.03 Grok runs used NeMo 24.12's YAML launcher (grok1/launch.sh
# FW_VERSION=24.12), its 25.05 releases NeMo 2's performance scripts (deepseek_v3/pretraining and grok1 launch.sh:
# NeMo 25.04, `python3 -m scripts.performance.llm.pretrain_*`).
FAMILY_STACKS = {"narayanan21": "megatron-lm-2021", "mtnlg": "megatron-deepspeed-2021", "bloom": "megatron-deepspeed-2021",
                 "opt": "megatron-lm-2021", "korthikanti22": "megatron-lm-2022", "mbridge": "megatron-bridge",
                 "nemo2407": "nemo", "dgxc": "nemo", "dgxc-250504": "nemo-2", "torchtitan": "torchtitan",
                 "pangu": "mindspeed", "megatron24": "megatron-core"}
FAMILY_STACK_SETTINGS = {
    # Megatron-Bridge runs combined 1F1B only where a recipe sets overlap_moe_expert_parallel_comm (the rows
    # whose recipes set it say so below): the settings-given prediction takes it off, where the plain path's
    # search chooses it
    "mbridge": {"moe_a2a_overlap": False},
}
DEFAULT_FAMILY_STACK = "nemo"


# Per-run stack facts read in the launcher a run used (a user passes them as the CLI's stack flags)
# Megatron-Bridge's DeepSeek-V3 recipe (src/megatron/bridge/recipes/deepseek/deepseek_v3.py, v0.2.1 and @6476ea0f):
# use_precision_aware_optimizer, exp_avg_dtype and exp_avg_sq_dtype bf16, whatever the precision
DEEPSEEK_V3_OPTIMIZER = {"precision_aware_optimizer": "on", "adam_moment_bytes": 2}

RUN_STACK_SETTINGS = {
    # NVIDIA-NeMo/Megatron-Bridge scripts/performance/run_script.py @6476ea0f (October 2025, the 25.09 line):
    # DeepSeek-V3 on H100 sets overlap_moe_expert_parallel_comm (A2A_1F1B) and enable_deepep (H100 only):
    # `--moe-a2a-overlap --moe-dispatcher deepep`
    # and on H100 overlap_grad_reduce False: the DP reduction is not hidden in the last backward
    "mbridge-25p09-h100-deepseekv3-prec-na-1024gpu": {"moe_a2a_overlap": True, "moe_dispatcher": "deepep",
                                                      "dp_window_fraction": 0.0, **DEEPSEEK_V3_OPTIMIZER},
    # Megatron-Bridge v0.2.1's DeepSeek-V3 configs build on the recipe above (configs/deepseek/
    # deepseek_llm_pretrain.py: deepseek_v3_pretrain_config), in every precision
    # (configs/deepseek/workload_base_configs.py DEEPSEEK_V3_GB200_BASE_CONFIG, @d19cb73c: the BF16 row's degrees,
    # TP1 PP4 VP4 EP64, with moe_flex_dispatcher_backend "hybridep" and moe_a2a_overlap False: `--moe-dispatcher
    # deepep`, HybridEP on GB200 as the device profile says; the MXFP8 row's PP8 EP32 is not that config, so its
    # dispatcher is not known and stays the stack's default)
    "mbridge-25p11-gb200-deepseekv3-bf16-256gpu-wo-mtp": {**DEEPSEEK_V3_OPTIMIZER, "moe_dispatcher": "deepep"},
    "mbridge-25p11-gb200-deepseekv3-mxfp8-256gpu-wo-mtp": DEEPSEEK_V3_OPTIMIZER,
    # and on B200 with the alltoall dispatcher and without the a2a overlap, the DeepSeek provider's default
    # moe_shared_expert_overlap (src/megatron/bridge/models/deepseek/deepseek_provider.py, v0.2.1); on GB200 its
    # HybridEP (flex) dispatcher runs without it, as Megatron-Core requires
    "mbridge-25p11-b200-deepseekv3-mxfp8-256gpu-w-mtp": {**DEEPSEEK_V3_OPTIMIZER, "moe_shared_expert_overlap": True},
    # NVIDIA-NeMo/Megatron-Bridge v0.2.1 (the release whose performance summary has the 25.11 tables)
    # scripts/performance/configs/qwen3/workload_base_configs.py QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG: the
    # row's degrees and batch (256 GPUs, TP2 PP8 VP4 EP32, GBS 2048) with moe_a2a_overlap=True, which
    # utils/helpers.py set_moe_a2a_overlap_overrides turns into overlap_moe_expert_parallel_comm and
    # delay_wgrad_compute (combined 1F1B): `--moe-a2a-overlap`
    # configs/qwen3/qwen3_llm_pretrain.py qwen3_235b_a22b_h100_config: CommOverlapConfig(tp_comm_overlap=False):
    # `--moe-a2a-overlap`, TP overlap off
    "mbridge-25p11-h100-qwen3-235b-a22b-fp8-256gpu": {"moe_a2a_overlap": True, "tp_comm_overlap": False},
    # NVIDIA/NeMo 6f2c6fda (dgxc-benchmarking v25.05.04 grok1/setup.sh's NEMO_COMMIT) scripts/performance/llm/
    # pretrain_grok1_314b.py: MegatronCommOverlapCallback(tp_comm_overlap=True): `--tp-comm-overlap`; and
    # MegatronTokenDropCallback (padded to capacity: no host split sizes)
    "dgxc-250504-grok-bf16-h100-512gpu": {"tp_comm_overlap": True, "moe_dispatch_host_sync": "never"},
    # NVIDIA/NeMo 7a8f1cc7 (dgxc-benchmarking v25.05.04 deepseek_v3 setup.sh's NEMO_COMMIT) scripts/performance/llm/
    # pretrain_deepseek_v3.py: cross_entropy_fusion_impl "te" (GPTConfig's cross_entropy_loss_fusion on); its
    # DeepSeekV3Config (nemo/collections/llm/gpt/model/deepseek.py): alltoall dispatcher, moe_shared_expert_overlap
    # ... and its USE_TOKEN_DROP adds MegatronTokenDropCallback (nemo/lightning/pytorch/callbacks/moe_token_drop.py:
    # capacity factor 1.0, padded to capacity), whose dispatcher reads no split sizes on the host
    "dgxc-250504-dsv3-bf16-h100-512gpu": {"loss_gradient": "fused", "moe_shared_expert_overlap": True,
                                          "moe_dispatch_host_sync": "never"},
}


def run_family(run_id: str) -> str:
    """The longest FAMILY_STACKS prefix of a run id (its first word at least)."""
    words = run_id.split("-")
    prefixes = ("-".join(words[:n]) for n in range(len(words), 0, -1))
    return next((p for p in prefixes if p in FAMILY_STACKS), words[0])


def run_stack(run_id: str) -> SoftwareStack:
    """The software stack a published run is predicted with, through the public API's `stack=`."""
    family = run_family(run_id)
    stack = load_stack(FAMILY_STACKS.get(family, DEFAULT_FAMILY_STACK))
    settings = {**FAMILY_STACK_SETTINGS.get(family, {}), **RUN_STACK_SETTINGS.get(run_id, {})}
    # a run's recipe ran one MoE dispatcher: its stack's default unless the run's launcher says another
    dispatcher = settings.get("moe_dispatcher", stack.moe_dispatcher)
    return stack.model_copy(update={**settings, "moe_dispatchers": (dispatcher,)})


# Per-run layout facts read in the recipe a run used, where its source states them
RECIPE_SETTINGS = {
    # NeMo-Framework-Launcher conf/training/nemotron/nemotron_340b.yaml: optim mcore_distributed_optim,
    # grad_sync_dtype: bf16 (the family's other recipes use distributed_fused_adam without it)
    "nemo2407-nemotron-340b-128gpu": {"grad_reduce": "bf16"},
    # MT-NLG (arXiv 2201.11990 section 2.4): its 126/121/113 TFLOP/s per GPU are Narayanan et al.'s Eq. 3 applied
    # to the measured 60.1/50.2/44.4 s, the count that includes the recomputed forward pass (96 B s l h^2 ...;
    # the rows' flops_convention), so the runs recomputed every layer's activations; cli99/llm-analysis
    # examples/megatron-turing-nlg/run_train.sh reproduces them with --activation_recomputation 2 (full)
    **{f"mtnlg-530b-{n}gpu": {"recompute": "full"} for n in (2240, 2800, 3360)},
    # the same launcher line as RUN_STACK_SETTINGS' (run_script.py @6476ea0f): the run used combined 1F1B, so
    # it is pinned on rather than left to the search (`--fix a2a_overlap=true`); on H100 it sets recompute_modules
    # ["mla_up_proj", "mlp"]; configs/deepseek/deepseek_v3_llm_pretrain.yaml there: selective recomputation,
    # the pipeline layout "Et|(tt|)*30mL" (embedding + 1 decoder layer, 30 chunks of 2, MTP + loss: the 1,024-GPU
    # H100 entry's pp 8 x vp 4), ETP 1; its recipe takes the distributed optimizer (ZeRO-1); dp = GPUs / (tp pp cp)
    "mbridge-25p09-h100-deepseekv3-prec-na-1024gpu": {"a2a_overlap": True, "dp": 64, "etp": 1, "zero": 1,
                                                      "recompute": "selective", "recompute_modules": "mla_up_proj+mlp",
                                                      "stages": "1-2*30-1"},
    # the same configuration as RUN_STACK_SETTINGS' (Megatron-Bridge v0.2.1): combined 1F1B pinned on; ETP 1;
    # set_qwen3_common_configs sets recompute_granularity None (no recomputation); the recipe
    # (recipes/qwen/qwen3_moe.py qwen3_235b_a22b_pretrain_config) takes the distributed optimizer (ZeRO-1) and
    # counts the embedding and the loss as a layer each in the pipeline split (account_for_embedding/loss_in_
    # pipeline_split): 96 over 32 chunks, embedding + 2 decoder layers first, 3 in each, 2 + loss last;
    # dp = GPUs / (tp pp cp)
    "mbridge-25p11-h100-qwen3-235b-a22b-fp8-256gpu": {"a2a_overlap": True, "dp": 16, "etp": 1, "zero": 1,
                                                      "recompute": "none", "stages": "2-3*30-2"},
    # dgxc-benchmarking v25.05.04 deepseek_v3/pretraining/launch.sh (H100): `-vp 1 --expert_tensor_parallel_size 1
    # --recompute_modules mla_up_proj`; the NeMo script it runs (NVIDIA/NeMo 7a8f1cc7 scripts/performance/llm/
    # pretrain_deepseek_v3.py) sets recompute_granularity selective and num_layers_in_first/last_pipeline_stage
    # 64 / pp - 1 and - 2 (7 and 6 decoder layers at pp 8; Megatron-Core puts the MTP module in the last stage
    # beside them), its recipe's optimizer distributed_fused_adam_with_cosine_annealing use_distributed_optimizer
    # (ZeRO-1): the whole layout is stated, so the run is predicted as `evaluate` takes it (`predict`)
    "dgxc-250504-dsv3-bf16-h100-512gpu": {"vp": 1, "etp": 1, "zero": 1, "recompute": "selective",
                                          "recompute_modules": "mla_up_proj", "stages": "7-8*6-7"},
    # NVIDIA-NeMo/Megatron-Bridge v0.2.1 scripts/performance/configs/deepseek/workload_base_configs.py
    # DEEPSEEK_V3_B200_BASE_CONFIG: the row's degrees and batch (256 GPUs, PP16 EP8, GBS 2048) with ETP 1 and
    # recompute_modules ["mla_up_proj"] (selective, deepseek_llm_pretrain.py); its recipe
    # (recipes/deepseek/deepseek_v3.py) takes the distributed optimizer (ZeRO-1) and, for (pp 16, vp 1), the
    # pipeline layout embedding + 4 decoders, 14 x 4 decoders, 1 decoder + MTP + loss: `stages=4*15-2`
    # (and the precision label 'FP8-MX', as below; dp = GPUs / (tp pp cp), as the row's notes have it)
    "mbridge-25p11-b200-deepseekv3-mxfp8-256gpu-w-mtp": {"dp": 16, "etp": 1, "zero": 1, "recompute": "selective",
                                                         "recompute_modules": "mla_up_proj", "stages": "4*15-2",
                                                         "fp8_recipe": "mxfp8"},
    # the rows' precision label 'FP8-MX' (microscaling FP8: Megatron --fp8-recipe mxfp8); 'FP8-CS' rows take
    # the stack's first recipe, tensorwise
    **{run: {"fp8_recipe": "mxfp8"} for run in ("mbridge-25p11-gb200-deepseekv3-mxfp8-256gpu-wo-mtp",
                                                "mbridge-25p11-b200-qwen3-235b-a22b-mxfp8-64gpu")},
}


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
    sharded_parameters: bool = False   # its layout shards the parameters: zero 3 or fsdp (a pin only where an int)


# NVIDIA-NeMo/Megatron-Bridge scripts/performance/utils/executors.py @067f987d: on 4-GPU nodes (GB200) the
# launcher asks Slurm for `--segment`: the job's nodes if at most 18 (one NVL72 rack), else the largest node
# count of at most 18 that divides them; the job takes that many nodes in each rack
SEGMENTING_FAMILIES = ("mbridge",)
NVL72_SEGMENT_NODES = 18


def launcher_segment_devices(run_id: str, num_devices: int, devices_per_node: int) -> int | None:
    """The devices per scale-up domain the run's launcher asked for, as a user passes --segment-devices."""
    if run_id.split("-", 1)[0] not in SEGMENTING_FAMILIES or devices_per_node != 4:
        return None
    nodes = num_devices // devices_per_node
    if nodes <= NVL72_SEGMENT_NODES:
        return None   # one segment: the job sits in one rack, as it does without one
    segment = next(n for n in range(NVL72_SEGMENT_NODES, 0, -1) if nodes % n == 0)
    return segment * devices_per_node


MODEL_FIELDS_NEEDED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
MOE_FIELDS_NEEDED = ("num_experts", "router_topk", "moe_ffn_hidden_size")


def missing_model_fields(run: dict) -> list[str]:
    """The architecture fields a row leaves null that no prediction can do without."""
    model = run["model"]
    missing = [key for key in MODEL_FIELDS_NEEDED if model.get(key) is None]
    if isinstance(model.get("moe"), dict):
        missing += [f"moe.{key}" for key in MOE_FIELDS_NEEDED if model["moe"].get(key) is None]
    return missing


# Megatron-Bridge's tables name DeepSeek-V3 rows "w/ MTP" or "w/o MTP"; its recipes train one module
# (DeepSeek-V3's num_nextn_predict_layers: 1); the runs file has no field for it
MTP_MARK, MTP_MODULES = "w/ MTP", 1
# Runs whose launcher trains MTP without the row saying so. NVIDIA/NeMo 7a8f1cc7 (dgxc-benchmarking v25.05.04
# deepseek_v3/pretraining/setup.sh's NEMO_COMMIT): scripts/performance/llm/pretrain_deepseek_v3.py builds
# `pretrain_recipe()`, whose use_mtp defaults to True (nemo/collections/llm/recipes/deepseek_v3.py: mtp_num_layers=1)
# Megatron-Bridge @6476ea0f (the 25.09 line) runs DeepSeek-V3 with the layout "Et|(tt|)*30mL", whose m is the MTP
# module (recipes/deepseek/deepseek_v3.py there: mtp_num_layers=1)
MTP_BY_LAUNCHER = ("dgxc-250504-dsv3-bf16-h100-512gpu", "mbridge-25p09-h100-deepseekv3-prec-na-1024gpu")


# Model facts the runs file leaves out, by family: BLOOM trained without dropout (bigscience/bloom config.json and
# transformers' BloomConfig: hidden_dropout 0.0, attention_dropout 0.0); other rows leave it to their stack
STATED_DROPOUT = {"bloom": 0.0}


def _model(run: dict) -> ModelConfig:
    m = run["model"]
    activation = m.get("activation") or "gelu"
    gpt = activation == "gelu"
    moe = m.get("moe")
    mla = m.get("mla")
    heads = m["num_attention_heads"]
    family = run_family(run["id"])
    stated = {"dropout": STATED_DROPOUT[family]} if family in STATED_DROPOUT else {}
    return ModelConfig(
        name=run["id"], num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=heads,
        num_query_groups=m.get("num_query_groups") or heads, head_dim=m.get("head_dim"),
        ffn_hidden_size=m.get("ffn_hidden_size") or 4 * m["hidden_size"], vocab_size=m.get("vocab_size") or 51200,
        seq_length=m["seq_length"], activation=activation, normalization="layernorm" if gpt else "rmsnorm",
        position_embedding="learned" if gpt else "rope",
        tied_embeddings=gpt if m.get("tied_embeddings") is None else bool(m["tied_embeddings"]),
        attention="mla" if mla else ("mha" if (m.get("num_query_groups") or heads) == heads else "gqa"),
        add_bias=gpt if m.get("add_bias") is None else bool(m["add_bias"]), mla=MLAConfig(**mla) if mla else None,
        # sliding windows: no runs-file field; a completed model's fills give them (accuracy.py COMPLETED_MODELS)
        sliding_window=m.get("sliding_window"), sliding_layers=m.get("sliding_layers"),
        moe=MoEConfig(**{MOE_FIELDS.get(k, k): v for k, v in moe.items() if v is not None}) if moe else None,
        mtp_layers=MTP_MODULES if MTP_MARK in m["name"] or run["id"] in MTP_BY_LAUNCHER else 0,
        **stated)


def _step_time(run: dict, gbs: int, seq: int) -> tuple[float | None, str]:
    measured = run["measured"]
    if measured.get("step_time_s"):
        return float(measured["step_time_s"]), "step_time_s"
    per_device = measured.get("tokens_per_s_per_device")
    if per_device:
        return gbs * seq / (per_device * run["hardware"]["num_devices"]), "tokens_per_s_per_device"
    return None, ""


def _filled(run: dict, fills: dict) -> dict:
    """The row with model fields it leaves null set (`fills`: field -> value; "moe.x" inside the moe section)."""
    model = dict(run["model"])
    for key, value in fills.items():
        if key.startswith("moe."):
            model["moe"] = {**(model.get("moe") or {}), key[4:]: value}
        else:
            model[key] = value
    return {**run, "model": model}


UNSTATED_PRECISION = "precision not stated, on a device that trains in BF16 or FP8"


def precision_unstated(run: dict) -> bool:
    """The row leaves its precision open where it matters: the device has an FP8 peak (an A100 row's null
    means 16-bit, the only way that device trains)."""
    device = run["hardware"]["device"]
    return run["layout"].get("precision") is None and device in list_devices() \
        and bool(load_device(device).peak_tflops.fp8)


def load_runs(path: Path | str = DEFAULT_RUNS, model_fills: dict[str, dict] | None = None,
              unstated_precision: str | None = None) -> tuple[list[PublishedRun], list[tuple[str, str]]]:
    """Runs that can be predicted, and (id, why not) for the rest. `model_fills` (run id -> field -> value)
    completes rows whose model the source leaves partly unstated; only rows named there are returned.
    A row whose precision is unstated where the device could train in BF16 or FP8 is not predicted (a
    prediction would assume it); `unstated_precision` ("bf16" or "fp8") returns those rows alone, read so."""
    runs, skipped = [], []
    for run in yaml.safe_load(Path(path).read_text()):
        if model_fills is not None:
            if run["id"] not in model_fills:
                continue
            run = _filled(run, model_fills[run["id"]])
        layout, hardware = run["layout"], run["hardware"]
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
        missing = missing_model_fields(run)
        if missing:
            skipped.append((run["id"], f"model fields not given: {', '.join(missing)}"))
            continue
        try:
            model = _model(run)
        except Exception as exc:  # an incomplete model row
            skipped.append((run["id"], f"model incomplete: {str(exc).splitlines()[0]}"))
            continue
        if (unstated_precision is not None) != precision_unstated(run):
            if unstated_precision is None:
                skipped.append((run["id"], UNSTATED_PRECISION))
            continue
        known = {key: layout[src] for src, key in LAYOUT_FIELDS.items() if layout.get(src) is not None}
        if layout.get("recompute"):
            known["recompute"] = layout["recompute"]
        if isinstance(layout.get("zero"), int):
            known["zero"] = layout["zero"]
        if layout.get("sequence_parallel") is not None:
            known["sp"] = bool(layout["sequence_parallel"])
        known.update(RECIPE_SETTINGS.get(run["id"], {}))
        cluster = cluster_from_device(hardware["device"], hardware["num_devices"], hardware.get("devices_per_node"))
        # as a user passes --segment-devices: the same check, the same cluster
        cluster = resolve_cluster(cluster, segment_devices=launcher_segment_devices(
            run["id"], cluster.num_devices, cluster.devices_per_node))
        precision = unstated_precision or ("fp8" if layout.get("precision") == "fp8" else "bf16")
        runs.append(PublishedRun(run["id"], model, cluster, gbs, seq, known, step, field, run.get("evidence", ""),
                                 run["measured"].get("flops_convention", ""), precision,
                                 layout.get("zero") in (3, "fsdp")))
    return runs, skipped


ASSUMED_WHERE_UNSTATED = {"recompute": "none", "zero": 1, "ep": 1, "etp": 1, "vp": 1}
# departures from the assumptions, cheapest in step time first, tried one at a time where the source
# leaves the field out: bf16 gradient buffers (NeMo's FP8 performance recipes set grad_sync_dtype: bf16,
# e.g. NeMo-Framework-Launcher gpt3/20b_fp8_performance.yaml), more sharding, then recomputation
UNSTATED_CHOICES = (("grad_reduce", "bf16"), ("zero", 2), ("zero", 3), ("recompute", "selective"),
                    ("recompute", "full"))


def published_values(run: PublishedRun) -> dict | None:
    """The run's whole layout as `evaluate` values when the source gives every degree and the micro-batch;
    what it leaves out is ASSUMED_WHERE_UNSTATED (Megatron's defaults), ZeRO-0 where the run's stack has no
    distributed optimizer."""
    need = ("tp", "pp", "dp", "cp", "mbs")
    if not all(k in run.known for k in need):
        return None
    known = {key: value for key, value in run.known.items() if key in LAYOUT_KEYS}
    assumed = dict(ASSUMED_WHERE_UNSTATED)
    if assumed["zero"] not in run_stack(run.id).zero_stages:
        assumed["zero"] = 0
    return {**assumed, **known}


@dataclass(frozen=True)
class PublishedCheck:
    """A published layout predicted as is, and what an unstated choice needs to make it fit."""
    run: PublishedRun
    values: dict
    predicted: object            # planner.plans.Plan of the layout as published
    stated: bool                 # the source states recomputation and ZeRO: no choice is left open
    fits_with: str | None        # the first unstated choice that fits (`UNSTATED_CHOICES`), where it needs one


def check_published(run: PublishedRun) -> PublishedCheck | None:
    from planner.api import evaluate
    values = published_values(run)
    if values is None:
        return None
    stack = run_stack(run.id)

    def predict_with(changed: dict):
        return evaluate(run.model, run.cluster, {**values, **changed}, global_batch=run.global_batch,
                        seq_len=run.seq_len, precision=run.precision, stack=stack)

    predicted = predict_with({})
    stated = "recompute" in run.known and "zero" in run.known
    fits_with = None
    if not predicted.fits:
        for key, value in UNSTATED_CHOICES:
            allowed = (key != "zero" or value in stack.zero_stages) and \
                (value != "selective" or stack.selective_recompute)
            if key in run.known or not allowed:
                continue
            trial = predict_with({key: value})
            if trial.fits:
                fits_with = f"{key}={value} ({trial.peak_memory_bytes / 1e9:.1f} GB)"
                break
    return PublishedCheck(run, values, predicted, stated, fits_with)


def predict(run: PublishedRun, time_limit_s: float = 20.0):
    """The planner's best plan for the run's published layout through the public API: the fields the
    source leaves out are searched within what the run's stack can do."""
    from planner.api import evaluate, plan
    if "stages" in run.known:   # a stated split comes with the whole layout, which `evaluate` takes
        return evaluate(run.model, run.cluster, run.known, global_batch=run.global_batch, seq_len=run.seq_len,
                        precision=run.precision, time_limit_s=time_limit_s, stack=run_stack(run.id))
    return plan(run.model, run.cluster, global_batch=run.global_batch, seq_len=run.seq_len,
                precision=run.precision, time_limit_s=time_limit_s, top_k=1, stack=run_stack(run.id), **run.known)
