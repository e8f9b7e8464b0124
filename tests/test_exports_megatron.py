"""Megatron exports checked by Megatron-Core's own configuration classes (megatron-core, a test extra):
the exported flags, read as Megatron's argument parser maps them onto `TransformerConfig` and
`DistributedDataParallelConfig`, must construct (their __post_init__ checks the combination) and read
back the plan's degrees, schedule, recomputation, precision, overlaps and dispatcher (issue 18)."""
import itertools
import shlex
import sys
import types
import warnings

import pytest
import torch

from hardware_profiles.loader import load_stack
from planner.api import evaluate
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import resolve_model
from planner.exports import megatron_args

with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # "Transformer Engine and Apex are not installed"
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

FULL = "tp={tp},pp={pp},vp={vp},dp={dp},cp={cp},ep={ep},etp={etp},mbs={mbs},zero={zero},recompute={rc}"
MOE_OVERLAP = load_stack("megatron-core").model_copy(update={"moe_a2a_overlap": True, "tp_comm_overlap": True})
MTP_MOE = resolve_model("mixtral-8x7b").model_copy(update={"mtp_layers": 1, "num_layers": 8})
# (id, model, device, devices, global batch, layout, precision, stack)
PLANS = [
    ("dense-dp", "llama3-8b", "h100-sxm", 8, 64, FULL.format(tp=1, pp=1, vp=1, dp=8, cp=1, ep=1, etp=1, mbs=1, zero=1,
                                                                rc="none"), "bf16", None),
    ("tp-pp-vp-selective", "llama3-70b", "h100-sxm", 64, 64,
     FULL.format(tp=8, pp=4, vp=2, dp=2, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="selective"), "bf16", None),
    ("cp", "llama3-8b", "h100-sxm", 16, 32, FULL.format(tp=2, pp=1, vp=1, dp=2, cp=4, ep=1, etp=1, mbs=1, zero=1,
                                                          rc="none"), "bf16", None),
    ("moe-ep-etp", "mixtral-8x7b", "h100-sxm", 32, 64,
     FULL.format(tp=2, pp=2, vp=1, dp=8, cp=1, ep=8, etp=2, mbs=1, zero=1, rc="selective"), "bf16", None),
    ("zero3", "llama3-8b", "h100-sxm", 16, 64, FULL.format(tp=1, pp=1, vp=1, dp=16, cp=1, ep=1, etp=1, mbs=1, zero=3,
                                                             rc="none"), "bf16", None),
    ("zero2", "llama3-8b", "h100-sxm", 16, 64, FULL.format(tp=2, pp=1, vp=1, dp=8, cp=1, ep=1, etp=1, mbs=1, zero=2,
                                                             rc="none"), "bf16", None),
    ("fp8-tensorwise", "llama3-8b", "h100-sxm", 8, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=4, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="none") + ",fp8_recipe=tensorwise",
     "fp8", None),
    # microscaling FP8 on Blackwell (Megatron-Bridge's 'FP8-MX' rows)
    ("fp8-mxfp8-b200", "llama3-8b", "b200", 8, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=4, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="none") + ",fp8_recipe=mxfp8",
     "fp8", None),
    ("tp-and-moe-overlap", "mixtral-8x7b", "h100-sxm", 16, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=8, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="selective"), "bf16", MOE_OVERLAP),
    # full recomputation: Megatron-Core refuses the MoE overlap beside it, so the prediction does without
    ("moe-overlap-stack-full-recompute", "mixtral-8x7b", "h100-sxm", 16, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=8, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="full"), "bf16", MOE_OVERLAP),
    # DeepEP's deduplicated dispatch, as predicted (dispatcher=deepep): Megatron's flex dispatcher
    ("moe-deepep", "mixtral-8x7b", "h100-sxm", 32, 64,
     FULL.format(tp=1, pp=2, vp=1, dp=16, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="none") + ",dispatcher=deepep", "bf16",
     None),
    # the same on GB200 NVL72, whose flex backend is HybridEP
    ("moe-hybridep-gb200", "mixtral-8x7b", "gb200", 32, 64,
     FULL.format(tp=1, pp=2, vp=1, dp=16, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="none") + ",dispatcher=deepep", "bf16",
     None),
    # Megatron-Core's default dispatcher: every token all-gathered to the expert tp x ep group
    ("moe-allgather", "mixtral-8x7b", "h100-sxm", 32, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=16, cp=1, ep=8, etp=2, mbs=1, zero=1, rc="none") + ",dispatcher=allgather",
     "bf16", None),
    # the dispatcher left to evaluate, which weighs the three: the one it chose is exported
    ("moe-dispatcher-chosen", "qwen3-30b-a3b", "h100-sxm", 16, 64,
     FULL.format(tp=1, pp=1, vp=1, dp=16, cp=1, ep=16, etp=1, mbs=1, zero=1, rc="none"), "bf16", None),
    # Megatron-Bridge's stack: Transformer Engine's fused cross-entropy, the precision-aware optimizer in BF16
    ("megatron-bridge", "llama3-8b", "h100-sxm", 8, 64, FULL.format(tp=2, pp=1, vp=1, dp=4, cp=1, ep=1, etp=1, mbs=1,
                                                                     zero=1, rc="none"), "bf16", "megatron-bridge"),
    ("full-recompute", "llama3-70b", "h100-sxm", 32, 64,
     FULL.format(tp=8, pp=4, vp=1, dp=1, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="full"), "bf16", None),
    ("uneven-stages", "llama3-8b", "h100-sxm", 8, 32,
     FULL.format(tp=2, pp=4, vp=1, dp=1, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="none") + ",stages=10-8-8-6",
     "bf16", None),
    ("gb200-nvl72", "llama3-70b", "gb200", 72, 72,
     FULL.format(tp=4, pp=2, vp=2, dp=9, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="selective"), "bf16", None),
    ("12-devices", "llama3-8b", "h100-sxm", 12, 48, FULL.format(tp=2, pp=2, vp=1, dp=3, cp=1, ep=1, etp=1, mbs=1,
                                                                  zero=1, rc="none"), "bf16", None),
    # multi-token prediction: its layer is the plan's last block, written 'm' in the last chunk holding blocks
    ("mtp-pp-vp", MTP_MOE, "h100-sxm", 16, 64,
     FULL.format(tp=1, pp=2, vp=2, dp=8, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="none"), "bf16", None),
    ("mtp-one-stage", MTP_MOE, "h100-sxm", 8, 64,
     FULL.format(tp=1, pp=1, vp=1, dp=8, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="none"), "bf16", None),
    # Megatron FSDP on GB200 without recomputation: activations offloaded (--cpu-offloading-num-layers)
    ("offload-gb200", "llama3-70b", "gb200", 64, 256,
     FULL.format(tp=1, pp=1, vp=1, dp=64, cp=1, ep=1, etp=1, mbs=2, zero=3, rc="none") + ",fp8_recipe=tensorwise",
     "fp8", "megatron-bridge"),
    # selective recomputation of chosen modules (--recompute-modules)
    ("recompute-modules", "llama3-8b", "h100-sxm", 8, 64,
     FULL.format(tp=2, pp=1, vp=1, dp=4, cp=1, ep=1, etp=1, mbs=1, zero=1, rc="selective")
     + ",recompute_modules=mlp+layernorm", "bf16", None),
    # the experts' activation (GPT-OSS and DeepSeek-V3 recipes): Megatron-Core takes it with grouped GEMM only,
    # and under FP8 with current or block scaling only
    ("moe-act-fp8", "mixtral-8x7b", "h100-sxm", 32, 64,
     FULL.format(tp=1, pp=2, vp=1, dp=16, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="selective")
     + ",recompute_modules=layernorm+moe_act,fp8_recipe=tensorwise", "fp8", None),
]


def flags(args: list[str]) -> dict[str, str | bool]:
    """'--flag value...' -> {flag: the values joined by spaces, or True without one}."""
    words = shlex.split(" ".join(args))
    out, i = {}, 0
    while i < len(words):
        values = list(itertools.takewhile(lambda w: not w.startswith("--"), words[i + 1:]))
        out[words[i]] = " ".join(values) if values else True
        i += 1 + len(values)
    return out


def megatron_configs(exported: dict, graph, add_bias: bool):
    """The two configs, filled from the flags as Megatron-LM's arguments.py does (core_transformer_config_from_args
    and the DDP config in training.py), with the model's sizes from the captured graph."""
    structure = graph.structure(graph.blocks[-1].kind)
    pp = int(exported["--pipeline-model-parallel-size"])
    per_chunk = exported.get("--num-layers-per-virtual-pipeline-stage")
    moe = dict(num_moe_experts=graph.num_experts, moe_router_topk=structure.router_topk,
               moe_token_dispatcher_type=exported.get("--moe-token-dispatcher-type", "allgather"),
               moe_flex_dispatcher_backend=exported.get("--moe-flex-dispatcher-backend", "deepep"),
               moe_grouped_gemm=bool(exported.get("--moe-grouped-gemm"))) \
        if graph.num_experts else {}
    recompute = {}
    if "--recompute-granularity" in exported:
        recompute["recompute_granularity"] = exported["--recompute-granularity"]
        if "--recompute-modules" in exported:
            recompute["recompute_modules"] = exported["--recompute-modules"].split()
        if "--recompute-method" in exported:
            recompute.update(recompute_method=exported["--recompute-method"],
                             recompute_num_layers=int(exported["--recompute-num-layers"]))
    fp8 = dict(fp8=exported["--fp8-format"], fp8_recipe=exported["--fp8-recipe"]) if "--fp8-format" in exported else {}
    transformer = TransformerConfig(
        num_layers=graph.num_blocks - graph.mtp_layers, mtp_num_layers=graph.mtp_layers or None, hidden_size=graph.hidden_size, num_attention_heads=graph.attention_heads,
        num_query_groups=graph.kv_groups, tensor_model_parallel_size=int(exported["--tensor-model-parallel-size"]),
        pipeline_model_parallel_size=pp, context_parallel_size=int(exported["--context-parallel-size"]),
        expert_model_parallel_size=int(exported["--expert-model-parallel-size"]),
        expert_tensor_parallel_size=int(exported["--expert-tensor-parallel-size"]),
        virtual_pipeline_model_parallel_size=graph.num_blocks // (pp * int(per_chunk)) if per_chunk else None,
        pipeline_model_parallel_layout=exported.get("--pipeline-model-parallel-layout"),
        sequence_parallel=bool(exported.get("--sequence-parallel")), tp_comm_overlap=bool(exported.get("--tp-comm-overlap")),
        overlap_moe_expert_parallel_comm=bool(exported.get("--overlap-moe-expert-parallel-comm")),
        delay_wgrad_compute=bool(exported.get("--delay-wgrad-compute")),
        cross_entropy_loss_fusion=bool(exported.get("--cross-entropy-loss-fusion")),
        cross_entropy_fusion_impl=exported.get("--cross-entropy-fusion-impl", "native"),
        # Megatron-LM's arguments.py turns cpu_offloading on where the count is positive
        cpu_offloading=int(exported.get("--cpu-offloading-num-layers", 0)) > 0,
        cpu_offloading_num_layers=int(exported.get("--cpu-offloading-num-layers", 0)),
        add_bias_linear=add_bias, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, **moe, **recompute, **fp8)
    sharding = exported.get("--data-parallel-sharding-strategy", "no_shard")
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not exported.get("--grad-reduce-in-bf16"),
        overlap_grad_reduce=bool(exported.get("--overlap-grad-reduce")),
        overlap_param_gather=bool(exported.get("--overlap-param-gather")),
        use_distributed_optimizer=bool(exported.get("--use-distributed-optimizer")),
        use_megatron_fsdp=bool(exported.get("--use-megatron-fsdp")), data_parallel_sharding_strategy=sharding)
    return transformer, ddp


@pytest.mark.parametrize("case", PLANS, ids=[c[0] for c in PLANS])
def test_megatron_core_configs_accept_the_export_and_mean_the_plan(case, monkeypatch):
    name, model, device, count, batch, layout, precision, stack = case
    # Transformer Engine >= 2.6 stood in (FP8 moe_act and layernorm recomputation ask for it; not installed here)
    monkeypatch.setattr(sys.modules[TransformerConfig.__module__], "is_te_min_version", lambda *_, **__: True)
    per_node = 4 if count % 8 else None   # 12 devices: three nodes of 4
    plan = evaluate(model, device=device, num_devices=count, devices_per_node=per_node, global_batch=batch,
                    layout=layout, precision=precision, stack=stack)
    args, _ = megatron_args(plan)
    exported = flags(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer, ddp = megatron_configs(exported, capture(model), resolve_model(model).add_bias)
    lay = plan.layout
    assert (transformer.tensor_model_parallel_size, transformer.pipeline_model_parallel_size,
            transformer.context_parallel_size, transformer.expert_model_parallel_size,
            transformer.expert_tensor_parallel_size) == (lay.tp, lay.pp, lay.cp, lay.ep, lay.etp)
    # every chunk holds the plan's decoder layers, in the plan's order
    if transformer.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.enums import LayerType
        parsed = transformer.pipeline_model_parallel_layout
        for stage in plan.stages:
            vp_stage, pp_rank = divmod(stage.index, lay.pp)
            chunk = parsed.layout[pp_rank][vp_stage]
            assert chunk.count(LayerType.decoder) + chunk.count(LayerType.mtp) == len(stage.layers)
        assert parsed.flatten_layout.count(LayerType.mtp) == plan.mtp_layers == int(exported.get("--mtp-num-layers", 0))
    else:
        assert (transformer.virtual_pipeline_model_parallel_size or 1) == lay.vp
    assert transformer.sequence_parallel == (lay.sp and lay.tp > 1)
    assert transformer.tp_comm_overlap == lay.tp_comm_overlap
    assert (transformer.cpu_offloading, transformer.cpu_offloading_num_layers) == (lay.offload_layers > 0,
                                                                                   lay.offload_layers)
    assert name != "offload-gb200" or lay.offload_layers > 0
    assert transformer.overlap_moe_expert_parallel_comm == lay.moe_a2a_overlap
    assert (transformer.cross_entropy_loss_fusion and transformer.cross_entropy_fusion_impl == "te") == lay.fused_loss
    methods = {r for stage in plan.stages for r in stage.recompute}
    assert transformer.recompute_granularity == (None if methods == {"none"} else
                                                 "selective" if methods == {"selective"} else "full")
    if methods == {"full"}:
        assert transformer.recompute_num_layers == max(len(s.layers) for s in plan.stages)
    if methods == {"selective"}:   # Megatron-Core fills its default, ["core_attn"], where none is given
        assert transformer.recompute_modules == lay.recompute_modules.split("+")
    assert (transformer.fp8 is not None) == (lay.precision == "fp8")
    if lay.precision == "fp8":
        assert transformer.fp8_recipe == lay.fp8_recipe
    if lay.ep > 1:   # what the cost model bills: a plain all-to-all, an all-gather, or DeepEP through flex
        deepep = lay.moe_dispatcher == "deepep"
        assert transformer.moe_token_dispatcher_type == ("flex" if deepep else lay.moe_dispatcher)
        assert not deepep or transformer.moe_flex_dispatcher_backend == lay.flex_dispatcher_backend
    # ZeRO: 1 the distributed optimizer, 2 and 3 Megatron-FSDP sharding gradients (and parameters)
    assert ddp.use_distributed_optimizer == (lay.zero >= 1)
    assert ddp.data_parallel_sharding_strategy == {0: "no_shard", 1: "no_shard", 2: "optim_grads",
                                                   3: "optim_grads_params"}[lay.zero]
    assert ddp.grad_reduce_in_fp32 == (lay.grad_reduce == "fp32")
    # the prediction hid the DP reduction and ZeRO's gather in backward: the export asks for it
    assert ddp.overlap_grad_reduce == (lay.dp * lay.cp > 1)
    assert ddp.overlap_param_gather == (lay.dp * lay.cp > 1 and lay.zero >= 1)


@pytest.mark.parametrize("device,count,per_node", [("h100-sxm", 16, None), ("gb200", 8, None), ("h100-sxm", 12, 4)])
def test_torchrun_export_is_what_torch_distributed_run_parses(device, count, per_node, tmp_path):
    """torch's own launcher parser reads the exported line: nodes and processes per node from the plan's
    cluster (GB200 NVL72 nodes hold 4), the world size the plan's, absolute paths (issue 18)."""
    from pathlib import Path

    from torch.distributed.run import get_args_parser

    from planner.exports import torchrun_command
    plan = evaluate("tiny-llama", device=device, num_devices=count, devices_per_node=per_node, global_batch=count,
                    layout=f"tp=1,pp=1,vp=1,dp={count},cp=1,ep=1,etp=1,mbs=1,zero=1,recompute=none",
                    stack="parallel-planner")
    path = tmp_path / "plan.yaml"
    plan.save(path)
    line, _ = torchrun_command(plan, str(path))
    words = shlex.split(line.replace("${MASTER_ADDR}", "head-node"))
    assert words[0] == "torchrun"
    parsed = get_args_parser().parse_args(words[1:])
    assert int(parsed.nnodes) * int(parsed.nproc_per_node) == plan.num_devices
    assert int(parsed.nproc_per_node) == plan.devices_per_node
    assert parsed.module and parsed.training_script == "runtime.train"   # installed with the package
    plan_arg = parsed.training_script_args[parsed.training_script_args.index("--plan") + 1]
    assert Path(plan_arg).is_absolute() and Path(plan_arg).exists()


def test_mla_up_projection_recomputation_is_exported_as_megatron_core_takes_it():
    """DeepSeek-V3 as Megatron-Bridge's H100 recipes run it: selective recomputation of mla_up_proj and the
    dense layers' mlp. Megatron-Core 0.16.1's MLATransformerConfig validates the flags (it refuses
    mla_up_proj without latent attention)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = resolve_model("deepseek-v3").model_copy(update={"num_layers": 4})
    plan = evaluate(cfg, device="h100-sxm", num_devices=64, global_batch=64,
                    layout=FULL.format(tp=2, pp=2, vp=1, dp=16, cp=1, ep=32, etp=1, mbs=1, zero=1, rc="selective")
                    + ",recompute_modules=mla_up_proj+mlp")
    args, notes = megatron_args(plan)
    exported = flags(args)
    assert exported["--recompute-modules"] == "mlp mla_up_proj"
    assert [note for note in notes if "CUDA_DEVICE_MAX_CONNECTIONS" not in note] == []
    mla = cfg.mla
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = MLATransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
            q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
            recompute_granularity=exported["--recompute-granularity"],
            recompute_modules=exported["--recompute-modules"].split(), bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16)
        assert transformer.recompute_modules == ["mlp", "mla_up_proj"]
        with pytest.raises(ValueError, match="mla_up_proj"):
            TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, recompute_granularity="selective",
                              recompute_modules=["mla_up_proj"])


@pytest.mark.parametrize("stack_name", ["megatron-core", "nemo-2", "megatron-bridge"])
def test_megatron_core_stacks_name_only_what_megatron_core_takes(stack_name):
    """Each recompute module and FP8 recipe a Megatron-Core-based stack offers is one Megatron-Core 0.16.1
    accepts: MLATransformerConfig validates the modules (with grouped GEMM, which moe_act needs and the export
    asks for beside it), its Fp8Recipe enum names the recipes."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    stack = load_stack(stack_name)
    assert set(stack.fp8_recipes) <= {recipe.value for recipe in Fp8Recipe}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in stack.recompute_modules:
            transformer = MLATransformerConfig(
                num_layers=4, hidden_size=64, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
                qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, num_moe_experts=4, moe_router_topk=2,
                moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=[module])
            assert transformer.recompute_modules == [module]


OPTIMIZER_CASES = [   # (stack, precision, ZeRO stage, layout suffix)
    ("megatron-bridge", "bf16", 1, ""),                       # its scripts' BF16 runs: remainders, fp32 moments
    ("megatron-bridge", "fp8", 1, ",fp8_recipe=tensorwise"),  # FP8 runs: the plain optimizer
    ("megatron-bridge", "bf16", 0, ""),                       # no distributed optimizer: the plain one
    ("deepseek-recipe", "fp8", 1, ",fp8_recipe=tensorwise"),  # bf16 moments; Megatron-Core keeps an fp32 master
    ("deepseek-recipe", "bf16", 1, ""),
    ("megatron-core", "bf16", 1, ""),
]


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=[f"{c[0]}-{c[1]}-zero{c[2]}" for c in OPTIMIZER_CASES])
def test_the_optimizer_states_a_plan_holds_are_what_megatron_cores_optimizer_config_keeps(case, monkeypatch):
    """The exported optimizer flags build Megatron-Core 0.16.1's OptimizerConfig (Transformer Engine >= 2.1, as
    the stacks assume: its __post_init__ asks TE's version), and the plan's optimizer bytes per parameter are
    what that config keeps: the fp32 master whole, or as 16-bit remainders (store_param_remainders, its
    default) where TE holds it (no FP8, or delayed scaling); each moment in exp_avg_dtype's bytes. The config
    refuses the precision-aware optimizer without the distributed one, so ZeRO-0 plans never assume it."""
    import megatron.core.optimizer.optimizer_config as optimizer_config

    stack_name, precision, zero, recipe = case
    stack = load_stack("megatron-bridge").model_copy(update={"precision_aware_optimizer": "on",
                                                            "adam_moment_bytes": 2}) \
        if stack_name == "deepseek-recipe" else stack_name
    plan = evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, precision=precision,
                    stack=stack, layout=FULL.format(tp=1, pp=1, vp=1, dp=8, cp=1, ep=1, etp=1, mbs=1, zero=zero,
                                                    rc="none") + recipe)
    exported = flags(megatron_args(plan)[0])
    # Transformer Engine >= 2.1 stood in for: its version, and FusedAdam's signature, which the config checks
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda version: True)
    te_optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te_optimizers.FusedAdam = lambda params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None, \
        use_decoupled_grad=False, store_param_remainders=False: None
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", te_optimizers)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    config = optimizer_config.OptimizerConfig(
        optimizer="adam", bf16=True, fp8_recipe=exported.get("--fp8-recipe"),
        use_distributed_optimizer=bool(exported.get("--use-distributed-optimizer")),
        use_precision_aware_optimizer=bool(exported.get("--use-precision-aware-optimizer")),
        exp_avg_dtype=dtypes[exported.get("--exp-avg-dtype", "fp32")],
        exp_avg_sq_dtype=dtypes[exported.get("--exp-avg-sq-dtype", "fp32")])
    te_holds_master = config.use_precision_aware_optimizer and config.fp8_recipe in (None, "delayed")
    master = 2 if te_holds_master and config.store_param_remainders else 4
    moments = config.exp_avg_dtype.itemsize + config.exp_avg_sq_dtype.itemsize
    parts = plan.memory[0].parts
    sharded = 8 if zero else 1   # ZeRO-1 shards the states over the 8 data-parallel ranks
    assert parts["optimizer"] * sharded / parts["weights"] * 2 == pytest.approx(master + moments)


def test_moe_act_under_delayed_fp8_is_refused_as_megatron_core_refuses_it(monkeypatch):
    """One rule set: Megatron-Core 0.16.1's TransformerConfig refuses moe_act (and layernorm) recomputation under
    FP8 delayed scaling, and moe_act without grouped GEMM; the planner refuses the first before any search,
    and its export asks for grouped GEMM wherever it recomputes moe_act."""
    from hardware_profiles.errors import UserInputError

    layout = FULL.format(tp=1, pp=2, vp=1, dp=16, cp=1, ep=8, etp=1, mbs=1, zero=1, rc="selective")
    for modules in ("moe_act", "layernorm"):
        with pytest.raises(UserInputError, match=f"recompute_modules={modules} with fp8_recipe=delayed"):
            evaluate("mixtral-8x7b", device="h100-sxm", num_devices=32, global_batch=64, precision="fp8",
                     layout=layout + f",recompute_modules={modules},fp8_recipe=delayed")
    common = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                  recompute_granularity="selective", recompute_modules=["moe_act"])
    monkeypatch.setattr(sys.modules[TransformerConfig.__module__], "is_te_min_version", lambda *_, **__: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="Delayed scaling does not support moe_act"):
            TransformerConfig(**common, moe_grouped_gemm=True, fp8="hybrid", fp8_recipe="delayed")
        with pytest.raises(ValueError, match="only supported with moe_grouped_gemm"):
            TransformerConfig(**common)
    plan = evaluate("mixtral-8x7b", device="h100-sxm", num_devices=32, global_batch=64,
                    layout=layout + ",recompute_modules=moe_act")
    assert "--moe-grouped-gemm" in flags(megatron_args(plan)[0])
