"""Every causal-LM family transformers ships, captured as the nn.Module it builds: code nobody here wrote.

Each family's own class (`AutoModelForCausalLM.from_config` on meta, a small config) is captured as a stack that
fuses norms and activations captures it. Capture may refuse a module (UserInputError: a forward that reads tensor
values, blocks that never run), but never fails otherwise: each crash class this sweep found stays closed
(a norm of two tensors, an op returning its own input inside a folded module, a depthwise convolution beside a
Linear taken for experts, a model whose largest ModuleList is an idle image encoder). Families whose small
config transformers itself refuses to build are skipped (36 of 196 at transformers 5.24).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import planner

from hardware_profiles.errors import UserInputError
from planner.graph_capture.model_capture import capture

transformers = pytest.importorskip("transformers")
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

SEQ = 64
# what each config class takes of these: two small layers, so a family's capture takes a fraction of a second
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "n_embd": 64, "n_head": 4,
         "n_layer": 2, "d_model": 64, "n_positions": 128, "moe_intermediate_size": 32, "head_dim": 16}
# families whose capture this sweep once crashed, and what their graph must hold: routed experts per MoE
# layer kind (None: a dense model), from the config transformers built
FIXED = {"zaya": "norm of q and k under fused norms", "deepseek_v4": "x.float() of a float x inside a norm",
         "inkling2_text": "depthwise conv1d beside a Linear", "qwen3_5_moe_text": "Gated DeltaNet's conv1d",
         "lara_mini": "linear attention's conv1d", "recurrent_gemma": "a recurrent block's conv1d",
         "mamba": "the mixer's conv1d beside dt_proj, a Linear of as many outputs reading dt_rank = kernel width",
         "jamba": "Mamba layers beside MoE ones"}


def small_module(model_type: str) -> torch.nn.Module:
    base = transformers.AutoConfig.for_model(model_type)
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items() if hasattr(base, k)})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _capture_or_refuse(module: torch.nn.Module):
    """The graph, or None where capture refuses the module with a UserInputError (any other error fails)."""
    try:
        return capture(module, seq_len=SEQ, fused_kernels=True, fused_gated_activation=True, attention_impl="flash")
    except UserInputError as exc:
        assert "\n" not in str(exc).strip(), str(exc)   # one paragraph
        assert "module ''" not in str(exc), str(exc)   # it names where, or the class whose own code failed
        return None


def config_experts(module: torch.nn.Module) -> int:
    """The routed experts a family's text config names where the module built them: stacked [E, ...] weights or
    a list of E modules (Doge, Flint and Beam name 16384 or 256 experts and build dense layers at their
    defaults); 0 for a dense model."""
    config = module.config.get_text_config()
    experts = next((getattr(config, key) for key in ("num_experts", "n_routed_experts", "num_local_experts")
                    if isinstance(getattr(config, key, None), int) and getattr(config, key) > 1), 0)
    stacked = any(p.dim() == 3 and p.shape[0] == experts for m in module.modules()
                  if not isinstance(m, torch.nn.modules.conv._ConvNd) for p in m.parameters(recurse=False))
    listed = any(isinstance(m, torch.nn.ModuleList) and len(m) == experts for m in module.modules())
    return experts if stacked or listed else 0


def experts_seen_or_said(graph, experts: int) -> bool:
    """Capture found the config's routed experts, or its notes say which stacked weights it could not route."""
    found = {kind.num_experts for kind in graph.kinds if kind.role == "block"}
    return experts in found or any("no router with that many outputs" in note for note in graph.capture_notes)


def test_every_transformers_causal_lm_is_captured_or_refused_in_one_paragraph():
    built, captured, failures = [], [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            module = small_module(model_type)
        except Exception:   # transformers refuses the small config (its own checks): not capture's concern
            continue
        built.append(model_type)
        try:
            graph = _capture_or_refuse(module)
        except Exception as exc:   # a crash class: reported together, with where it happened
            failures.append(f"{model_type}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        if graph is not None:
            captured.append(model_type)
            experts = config_experts(module)
            if experts and not experts_seen_or_said(graph, experts):
                failures.append(f"{model_type}: {experts} routed experts in its config, none captured, nothing said")
    assert not failures, "\n".join(failures)
    assert set(FIXED) <= set(captured), sorted(set(FIXED) - set(captured))
    assert len(built) >= 100, built   # the sweep reaches most families (160 of 196 build at transformers 5.24)


@pytest.mark.parametrize("model_type", sorted(FIXED))
def test_a_family_once_crashing_captures_its_layers_and_experts(model_type):
    module = small_module(model_type)
    graph = _capture_or_refuse(module)
    assert graph is not None, FIXED[model_type]
    experts = config_experts(module)
    found = {kind.num_experts for kind in graph.kinds if kind.role == "block"}
    assert found <= {0, experts}, (FIXED[model_type], found, experts)   # no attention or convolution as experts
    assert (experts in found) if experts and model_type != "zaya" else True, (FIXED[model_type], found)
    assert not experts or experts_seen_or_said(graph, experts), graph.capture_notes
    blocks = [slot for slot in graph.layers if slot.kind not in ("embedding", "head")]
    assert len(blocks) == module.config.get_text_config().num_hidden_layers


def test_zaya_experts_behind_an_mlp_router_are_said_not_silently_dense():
    """ZAYA scores E + 1 choices through an MLP: no router of E outputs, so no expert parallelism; the plan says so."""
    graph = _capture_or_refuse(small_module("zaya"))
    assert graph is not None
    assert any("mlp.experts.gate_up_proj" in note and "no expert parallelism" in note for note in graph.capture_notes)


def small_config_json(tmp_path, model_type: str, **extra) -> str:
    """transformers' own config for the family, small, written as a config.json (its to_dict(), as a hub file)."""
    base = transformers.AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in {**SMALL, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
                                "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 2048,
                                **extra}.items() if hasattr(base, k)}
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(transformers.AutoConfig.for_model(model_type, **sizes).to_dict(), default=str))
    return str(path)


@pytest.mark.parametrize("model_type", ["olmo2", "glm4_moe"])
def test_a_config_json_of_a_family_the_reader_does_not_map_plans_as_transformers_class(tmp_path, model_type):
    """OLMo 2 and GLM-4.5 (MoE) are no family config_from_hf maps: their config.json is built as transformers' own
    class and captured as that module, with the module's own parameters and routed experts, at the config's
    positions where no sequence is given."""
    path = small_config_json(tmp_path, model_type)
    module = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    graph = capture(path, fused_kernels=True)
    assert graph.model_class == type(module).__name__ and graph.seq_len == 2048
    assert graph.total_params == sum(p.numel() for p in module.parameters())
    experts = config_experts(module)
    assert {k.num_experts for k in graph.kinds if k.role == "block"} >= ({experts} if experts else {0})
    result = planner.plan(path, device="h100-sxm", num_devices=8, global_batch=16, seq_len=256)
    assert result.model == model_type and result.step_time_s > 0 and (experts or result.layout.ep == 1)


def test_a_kernel_run_as_its_torch_reference_is_said_in_every_capture(tmp_path):
    """Qwen3.5's Gated DeltaNet runs transformers' PyTorch reference where flash-linear-attention is not installed,
    and transformers warns once per process: each capture says it (two sequence lengths, two captures)."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: transformers runs its kernel, no reference")
    path = small_config_json(tmp_path, "qwen3_5_moe_text")
    for seq in (128, 256):
        notes = " ".join(capture(path, seq_len=seq, fused_kernels=True).capture_notes)
        assert "`chunk_gated_delta_rule` in 'linear_attn' as its PyTorch reference" in notes, notes
    # the module named a leaf, as the note offers: one op of its counted FLOPs, far fewer kernels, nothing said
    ops = sum(len(kind.ops) for kind in capture(path, seq_len=256, fused_kernels=True).kinds)
    leaf = capture(path, seq_len=256, fused_kernels=True, leaf_modules=("linear_attn",))
    assert not any("PyTorch reference" in note for note in leaf.capture_notes)
    assert sum(len(kind.ops) for kind in leaf.kinds) < ops / 2


def test_repeated_blocks_run_once_per_kind_in_the_whole_models_recording(monkeypatch):
    """The whole-model recording runs a block kind's forward once and gives its repeats that output's shapes (a
    1,000-layer config took 45 s to capture, 7 s so; Llama 3.1 405B's class 1.5 s, 0.5 s): 12 alike layers run
    twice in all (once there, once measured), not 13 times; the graph still holds all 12."""
    module = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **{**SMALL, "num_hidden_layers": 12})).to("meta")
    layer_class = type(module.model.layers[0])
    calls = []
    original = layer_class.forward
    monkeypatch.setattr(layer_class, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    graph = capture(module, seq_len=SEQ, fused_kernels=True)
    assert graph.layer_counts() == {"embedding": 1, "dense": 12, "head": 1}
    assert len(calls) == 2, len(calls)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 10 ** 9), ("hidden_size", 10 ** 8), ("vocab_size", -3),
                                       ("num_attention_heads", "8")])
def test_a_config_json_built_as_transformers_class_has_its_sizes_checked_first(tmp_path, key, value):
    """A hand-edited config.json of a family transformers builds: 10^9 layers would build for hours (a Python
    object per layer, meta or not); each size is checked against the reference decoder's limits first."""
    path = small_config_json(tmp_path, "olmo2")
    config = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps({**config, key: value}))
    with pytest.raises(UserInputError, match=f"field '{key}'"):
        capture(path, seq_len=128)
