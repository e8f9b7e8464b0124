"""Run by tests/test_exports_bridge.py in a process of its own: each Megatron-Bridge export merged into Megatron-Bridge
0.3's own pre-training ConfigContainer (`recipes/common.py _pretrain_common`, with the model's own Bridge provider)
by its `process_config_with_overrides`, then `runtime_config_update`: its mixed-precision recipe resolved and set
up, its data-parallel size computed and its `validate()` run (Megatron-Core's TransformerConfig and optimizer
checks included). Prints, per case, the fields read back as JSON.

What stands in for a GPU node, and only that: Megatron-Bridge's LoRA package (imported by the config module; it
imports Transformer Engine at import time) is an empty module, and the `megatron.bridge.recipes` package is
entered without its __init__ (which imports every recipe, their data providers GPU-only); the optimizer check
finds Transformer Engine's FusedAdam signature and version; the model's GPU kernel switches (rope fusion,
gradient-accumulation fusion, MoE permute fusion) are off; torch.cuda names the device the plan was made for. Every field the export writes is read by Bridge's own code.

    python tests/bridge_readback.py CASES.json   # [{"name", "model", "device", "world_size", "overrides": path}]
"""
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
import warnings

warnings.filterwarnings("ignore")
# the CUDA device the plan was made for, as torch.cuda.get_device_properties names it (Bridge's flex dispatcher
# check reads it: DeepEP runs on Ampere, Hopper, B200 and B300)
DEVICES = {"h100-sxm": (9, "NVIDIA H100 80GB HBM3"), "h800": (9, "NVIDIA H800"), "h200": (9, "NVIDIA H200"),
           "a100-80g": (8, "NVIDIA A100-SXM4-80GB"), "b200": (10, "NVIDIA B200"), "gb200": (10, "NVIDIA GB200")}
PROVIDERS = {"llama3-8b": "llama.Llama3ModelProvider8B", "llama3-70b": "llama.Llama3ModelProvider70B",
             "llama3-405b": "llama.Llama31ModelProvider405B", "qwen3-30b-a3b": "qwen.Qwen3MoEModelProvider30B_A3B",
             "qwen3-235b-a22b": "qwen.Qwen3MoEModelProvider235B_A22B", "deepseek-v3": "deepseek.DeepSeekV3ModelProvider"}


class _Empty(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        kind = type(name, (object,), {"__module__": self.__name__})
        setattr(self, name, kind)
        return kind


class _EmptyPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix: str):
        self.prefix = prefix

    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if fullname.startswith(self.prefix) \
            else None

    def create_module(self, spec):
        module = _Empty(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def bridge():
    sys.meta_path.insert(0, _EmptyPackage("megatron.bridge.peft"))
    import megatron.bridge
    recipes = types.ModuleType("megatron.bridge.recipes")
    recipes.__path__ = [os.path.join(os.path.dirname(megatron.bridge.__file__), "recipes")]
    sys.modules["megatron.bridge.recipes"] = recipes
    import megatron.bridge.recipes.common as common
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")

    class FusedAdam:   # the signature Megatron-Core's precision-aware optimizer check reads
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,
                     use_decoupled_grad=False):
            pass
    optimizers.FusedAdam = FusedAdam
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    sys.modules["transformer_engine.pytorch.optimizers"] = optimizers
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron.") and hasattr(module, "is_te_min_version"):
            module.is_te_min_version = lambda version, check_equality=True: True
    return common, process_config_with_overrides, runtime_config_update


def read_back(case: dict, common, merge, update) -> dict:
    import importlib
    module, name = PROVIDERS[case["model"]].split(".")
    provider = getattr(importlib.import_module(f"megatron.bridge.models.{module}"), name)
    cfg = common._pretrain_common()
    kernels = {"apply_rope_fusion": False, "gradient_accumulation_fusion": False, "moe_permute_fusion": False}
    cfg.model = provider(**{k: v for k, v in kernels.items() if k in provider.__dataclass_fields__})
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.vocab_size = cfg.model.vocab_size
    os.environ["WORLD_SIZE"] = str(case["world_size"])
    import torch
    major, device_name = DEVICES[case["device"]]
    torch.cuda.get_device_properties = lambda index=0: types.SimpleNamespace(major=major, minor=0, name=device_name)
    try:
        cfg = merge(cfg, config_filepath=case["overrides"])
        update(cfg)
    except Exception as exc:   # a refusal of Bridge's own checks: reported, the test fails naming it
        return {"name": case["name"], "refused": f"{type(exc).__name__}: {exc}"[:600]}
    m, mp = cfg.model, cfg.mixed_precision
    layout = m.pipeline_model_parallel_layout
    return {"name": case["name"], "tp": m.tensor_model_parallel_size, "pp": m.pipeline_model_parallel_size,
            "vp": m.virtual_pipeline_model_parallel_size, "cp": m.context_parallel_size,
            "ep": m.expert_model_parallel_size, "etp": m.expert_tensor_parallel_size, "sp": m.sequence_parallel,
            "dp": cfg.data_parallel_size, "gbs": cfg.train.global_batch_size, "mbs": cfg.train.micro_batch_size,
            "seq": [m.seq_length, cfg.dataset.seq_length], "num_layers": m.num_layers,
            "layers_per_chunk": layers_per_chunk(layout),
            "recompute": [m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                          list(m.recompute_modules or [])],
            "dispatcher": [m.moe_token_dispatcher_type, getattr(m, "moe_flex_dispatcher_backend", None)],
            "a2a_overlap": [m.overlap_moe_expert_parallel_comm, m.delay_wgrad_compute],
            "shared_expert_overlap": m.moe_shared_expert_overlap,
            "distributed_optimizer": [cfg.ddp.use_distributed_optimizer, cfg.optimizer.use_distributed_optimizer],
            "fsdp": [cfg.ddp.use_megatron_fsdp, cfg.ddp.data_parallel_sharding_strategy],
            "precision": [mp.bf16, mp.fp8, mp.fp8_recipe if mp.fp8 else None],
            "cuda_graphs": m.cuda_graph_impl, "fused_loss": m.cross_entropy_loss_fusion,
            "offload": [m.cpu_offloading, m.cpu_offloading_num_layers, m.cpu_offloading_weights]}


def layers_per_chunk(layout) -> list[int] | None:
    """Decoder layers per chunk in chunk order (chunk v * pp + rank), as Megatron-Core parsed the layout."""
    if layout is None or not hasattr(layout, "layout"):
        return None
    grid = layout.layout   # [pipeline rank][virtual stage] -> layer types
    return [sum(kind.name == "decoder" for kind in grid[rank][v]) for v in range(len(grid[0]))
            for rank in range(len(grid))]


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    common, merge, update = bridge()
    print(json.dumps([read_back(case, common, merge, update) for case in cases]))


if __name__ == "__main__":
    main()
