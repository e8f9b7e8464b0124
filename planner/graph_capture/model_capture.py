"""From a model argument to a `ModelGraph`: build on meta, trace, measure each layer kind once."""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import threading
import time
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map

from cost_models.records import LayerKind, OpCost, OpKind, ParamGroup, Sharding
from hardware_profiles.errors import UserInputError

from .recording import fresh_like, record
from .block_graphs import find_block_stack, trace
from .tracing import Measured, _Analyzer, block_params, measure_block, weight_pass_groups
from .graph import BlockStructure, LayerSlot, ModelGraph
from .graph_analysis import block_window
from .module_kinds import signature, stacked_weights
from .model_config import MAX_SEQ, ModelConfig
from .model_sources import UserModule, resolve_model
from .op_costs import tensor_bytes
from .reference_model import build_model
from .transformers_models import build_transformers_model, eager_only_class

ACTIVATION_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class _Kind:
    measured: Measured
    structure: BlockStructure
    block: nn.Module
    input_bytes: float
    front_end: str


class _TopAnalyzer(_Analyzer):
    """The whole model with blocks as leaves: measures each block kind once, skips repeats."""

    def __init__(self, gm, block_names: list[str], modules: dict[str, nn.Module], seq_len: int,
                 leaf_names: tuple[str, ...], fused_kernels: bool, fused_gated_activation: bool = False):
        self.block_names = set(block_names)
        self.first_block, self.last_block = block_names[0], block_names[-1]
        self.passed_first = False
        # the token embedding and output layer are vocabulary-parallel under tensor parallelism
        owners = dict(gm.named_modules())
        vocab_parallel = {n.name for n in gm.graph.nodes if n.op == "call_module"
                          and isinstance(owners.get(n.target), nn.Linear | nn.Embedding)}
        super().__init__(gm, vocab_parallel, seq_len, part_of=self._part_of, fused_kernels=fused_kernels,
                         fused_gated_activation=fused_gated_activation)
        self.block_modules = modules
        self.leaf_names = leaf_names
        self.kind_of_signature: dict[tuple, str] = {}
        self.kinds: dict[str, _Kind] = {}
        self.slots: list[LayerSlot] = []
        self.part_modules: dict[str, list[str]] = {}
        self.weights_read: list[str] = []   # embedding-part modules whose weights are read, not called

    def _is_parameter(self, target: str) -> bool:
        try:
            self.module.get_parameter(target)
            return True
        except AttributeError:
            return False

    def _part_of(self, node: fx.Node) -> str:
        if node.op == "call_module" and node.target in self.block_names:
            self.passed_first = True
            return "blocks"
        return "head" if self.passed_first else "embedding"

    def _kind_name(self, measured: Measured, structure: BlockStructure) -> str:
        base = "moe" if structure.num_experts else "dense"
        existing = [k for k in self.kinds if k.startswith(base)]
        return base if not existing else f"{base}{len(existing) + 1}"

    def run_node(self, node: fx.Node):
        if not (node.op == "call_module" and node.target in self.block_names):
            if node.op == "call_module" or (node.op == "get_attr" and not node.target.startswith("_constant")):
                owner = node.target if node.op == "call_module" else node.target.rsplit(".", 1)[0]
                modules = self.part_modules.setdefault("head" if self.passed_first else "embedding", [])
                if owner not in modules:
                    modules.append(owner)
                if node.op == "get_attr" and not self.passed_first and owner not in self.weights_read \
                        and self._is_parameter(node.target):   # a weight, not a buffer (rotary frequencies)
                    self.weights_read.append(owner)
            return super().run_node(node)
        self.current = node
        self._part_of(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        block = self.block_modules[node.target]
        window = block_window(block)   # layers alike but for a window shorter than the sequence are kinds apart
        window = window if window < self.seq_len else 0
        key = (signature(block), window)
        if key not in self.kind_of_signature:
            measured, structure, found = measure_block(block, args, kwargs, self.seq_len, node.target,
                                                       self.leaf_names, self.fused_kernels,
                                                       self.fused_gated_activation, window)
            name = self._kind_name(measured, structure)
            structure = BlockStructure(**{**structure.__dict__, "kind": name})
            self.kind_of_signature[key] = name
            self.kinds[name] = _Kind(measured, structure, block, tensor_bytes(args[0]), found.front_end)
        name = self.kind_of_signature[key]
        self.slots.append(LayerSlot(node.target, name))
        return tree_map(fresh_like, self.kinds[name].measured.output)


def _hidden_width(output) -> int:
    """A block's output width: its first floating tensor's last dimension (blocks may return tuples)."""
    first = next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())
    return int(first.shape[-1])


def _top_graph(model: nn.Module, block_ids: set[int], tokens: torch.Tensor, leaf_names: tuple[str, ...],
               name: str) -> tuple[fx.GraphModule, str]:
    """The whole model with its blocks as leaves: symbolically traced where torch.fx can read the code,
    else recorded from one eager run on meta (see recording.py); the token ids are real (cheap, and
    model code may branch on them)."""
    try:
        return trace(model, leaf_ids=block_ids, leaf_names=leaf_names, label=name), "torch.fx"
    except UserInputError:
        leaf_ids = block_ids | {id(m) for n, m in model.named_modules()
                                if n and any(n == leaf or n.endswith("." + leaf) for leaf in leaf_names)}
        real_tokens = torch.zeros(tokens.shape, dtype=tokens.dtype)
        return record(model, (real_tokens,), None, leaf_ids=leaf_ids, label=name,
                      repeated=block_ids).graph_module, "recorded"


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of a user's module on meta: its parameters and buffers are replaced, never copied or moved."""
    memo = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def _instantiate(source: ModelConfig | UserModule, seq_len: int) -> tuple[nn.Module, str]:
    if isinstance(source, ModelConfig):
        if seq_len > source.seq_length and source.position_embedding == "learned":
            raise UserInputError(f"sequence length {seq_len:,} exceeds {source.name}'s {source.seq_length:,} learned "
                                 "position embeddings (there is no position past them to look up)",
                                 field="seq_len", expected=f"at most {source.seq_length:,} (--seq-len)")
        cfg = source if seq_len <= source.seq_length else source.model_copy(update={"seq_length": seq_len})
        built = build_transformers_model(cfg) if cfg.hf_config else None
        return (built or build_model(cfg, "meta", ACTIVATION_DTYPE)), cfg.name
    if source.module is not None:  # an existing module: leave the user's weights where they are
        return _meta_copy(source.module).to(dtype=ACTIVATION_DTYPE), source.name
    try:
        with torch.device("meta"):
            module = source.factory()
    except SystemExit as exc:
        raise UserInputError(f"the factory called sys.exit({exc.code!r})", source=source.source,
                             expected="a factory that returns a torch.nn.Module") from None
    except UserInputError:   # a config.json transformers refuses: said as such (transformers_models.py)
        raise
    except Exception as exc:
        raise UserInputError(f"the factory failed: {type(exc).__name__}: {exc}", source=source.source) from None
    if not isinstance(module, nn.Module):
        raise UserInputError(f"the factory returned {type(module).__name__}", source=source.source,
                             expected="a torch.nn.Module")
    return module.to(device="meta", dtype=ACTIVATION_DTYPE), source.name


def _params_of(modules: list[nn.Module], seen: set[int]) -> list[ParamGroup]:
    counts = {Sharding.tensor: 0, Sharding.sequence: 0}
    tensors = dict.fromkeys(counts, 0)
    for module in modules:
        for sub in module.modules():
            for param in sub.parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                big = isinstance(sub, nn.Embedding | nn.Linear)  # vocab-parallel embedding and output layer
                sharding = Sharding.tensor if big else Sharding.sequence
                counts[sharding] += param.numel()
                tensors[sharding] += 1
    return [ParamGroup(c, s, tensors[s]) for s, c in counts.items() if c]


def _loss_op(seq_len: int, vocab: int) -> OpCost:
    # softmax cross-entropy over fp32 logits: read logits, write probabilities, read for the gradient
    moved = 3.0 * seq_len * vocab * 4
    return OpCost("loss", OpKind.loss, Sharding.tensor, 5.0 * seq_len * vocab, 2.0 * seq_len * vocab, 0.0,
                  moved, None)


def _output_layer_applications(ops, vocab: int) -> int:
    """GEMMs after the blocks that produce vocabulary-wide logits: the output layer, and once more per
    multi-token prediction module (each with a loss of its own)."""
    return max(1, sum(op.kind is OpKind.gemm and op.gemm_mnk is not None and op.gemm_mnk[1] == vocab for op in ops))


def _vocab_of(model: nn.Module) -> int:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise UserInputError("the model has no nn.Embedding to take token ids",
                             expected="a language model taking [batch, seq] token ids")
    return embeddings[0].num_embeddings


def _check_leaf_names(model: nn.Module, leaf_names: tuple[str, ...], name: str) -> None:
    """A leaf name that names no module would be billed as nothing: refused, with the names that exist."""
    names = [n for n, _ in model.named_modules() if n]
    for leaf in leaf_names:
        if not any(n == leaf or n.endswith("." + leaf) for n in names):
            sample = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})[:12]
            raise UserInputError(f"'{leaf}' names no module of {name}", field="--leaf-modules",
                                 expected="a module name or the end of a dotted name, such as "
                                          + ", ".join(sample))


# a graph is tens of KB: 256 of them keep every model a calibration or a benchmark weighs (about 50) captured once
@functools.lru_cache(maxsize=256)
def _capture_cached(source, seq_len: int, leaf_names: tuple[str, ...], fused_kernels: bool,
                    fused_gated_activation: bool = False) -> ModelGraph:
    start = time.perf_counter()
    model, name = _instantiate(source, seq_len)
    model.train()
    model_class = type(model).__name__
    stack_name, blocks = find_block_stack(model)
    if not blocks:
        raise UserInputError(f"no repeated blocks (an nn.ModuleList of layers) found in {name}",
                             expected="a model whose layers are held in an nn.ModuleList")
    _check_leaf_names(model, leaf_names, name)
    vocab = _vocab_of(model)
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    top, front_end = _top_graph(model, {id(module) for _, module in blocks}, tokens, leaf_names, name)
    analyzer = _TopAnalyzer(top, [n for n, _ in blocks], dict(blocks), seq_len, leaf_names, fused_kernels,
                            fused_gated_activation)
    parts = analyzer.measure(tokens)
    if not analyzer.kinds:   # GIT's largest ModuleList is its image encoder's, idle without pixels
        raise UserInputError(f"the {len(blocks)} repeated blocks found in {name} ({stack_name}) never run in its "
                             "forward from token ids", expected="a model whose largest nn.ModuleList holds the "
                             "layers the tokens pass through (for a multimodal model, pass its text decoder)")

    seen_params: set[int] = set()
    hidden = None
    kinds: list[LayerKind] = []
    structures = []
    block_param_ids = set()
    for kind_name, found in analyzer.kinds.items():
        measured, structure, block, input_bytes = found.measured, found.structure, found.block, found.input_bytes
        kinds.append(LayerKind(kind_name, "block", tuple(measured.ops), tuple(measured.saved),
                               block_params(block, structure), input_bytes, seq_len,
                               _hidden_width(measured.output), structure.num_experts, structure.router_topk,
                               router_num_groups=structure.router_num_groups,
                               router_group_topk=structure.router_group_topk,
                               tp_pair_count=len(structure.tp_pairs),
                               kv_channels=structure.kv_groups * structure.head_dim,
                               weight_pass_groups=weight_pass_groups(block)))
        structures.append(structure)
        if hidden is None:
            hidden = _hidden_width(measured.output)
    for _, block in blocks:
        block_param_ids |= {id(p) for p in block.parameters()}
    outside = [m for m in model.modules() if not list(m.children())]
    embeddings = [m for m in outside if isinstance(m, nn.Embedding)]
    seen_params |= block_param_ids
    embed_params = _params_of(embeddings, seen_params)
    head_params = _params_of([m for m in outside if not isinstance(m, nn.Embedding)], seen_params)
    embed = parts.get("embedding", Measured())
    head = parts.get("head", Measured())
    kinds.insert(0, LayerKind("embedding", "embedding", tuple(embed.ops), tuple(embed.saved),
                              tuple(embed_params), 0.0, seq_len, hidden, tp_pair_count=1))
    heads = _output_layer_applications(head.ops, vocab)
    kinds.append(LayerKind("head", "head", tuple(head.ops) + (_loss_op(seq_len, vocab),) * heads, tuple(head.saved),
                           tuple(head_params), hidden * seq_len * 2.0, seq_len, hidden,
                           logits_fp32_bytes=seq_len * vocab * 4.0 * heads, tp_pair_count=heads))
    slots = (LayerSlot("", "embedding"),) + tuple(analyzer.slots) + (LayerSlot("", "head"),)
    return ModelGraph(name=name, seq_len=seq_len, hidden_size=hidden, vocab_size=vocab,
                      activation_dtype_bytes=torch.finfo(ACTIVATION_DTYPE).bits // 8, block_stack=stack_name,
                      kinds=tuple(kinds), layers=slots, structures=tuple(structures),
                      embedding_modules=tuple(analyzer.part_modules.get("embedding", ())),
                      head_modules=tuple(analyzer.part_modules.get("head", ())),
                      embedding_weights_read=tuple(analyzer.weights_read),
                      capture_seconds=time.perf_counter() - start,
                      front_end=_front_end(front_end, analyzer.kinds.values()), model_class=model_class,
                      capture_notes=_notes([embed, head, *(k.measured for k in analyzer.kinds.values())])
                      + _unbuilt_mtp_notes(source, heads - 1) + _stand_in_notes(source)
                      + _unrouted_stacked_notes(analyzer.kinds),
                      mtp_layers=heads - 1)


def _unrouted_stacked_notes(kinds: dict[str, _Kind]) -> tuple[str, ...]:
    """Stacked [E, in, out] weights in a layer kind where no router of E outputs was found (ZAYA's router is an
    MLP scoring E + 1 choices): capture bills them as the layer's own weights, replicated, with no expert
    parallelism; said, not silent."""
    notes = []
    for name, kind in kinds.items():
        if kind.structure.num_experts:
            continue
        stacked = stacked_weights(kind.block)
        if stacked:
            shown = ", ".join(f"'{path}' {list(p.shape)}" for path, p in stacked[:3])
            notes.append(f"layer kind '{name}' holds stacked weights ({shown}) but no router with that many "
                         "outputs was found: billed as the layer's own weights (no expert parallelism, no routing)")
    return tuple(notes)


def _unbuilt_mtp_notes(source, captured: int) -> tuple[str, ...]:
    """A config.json that names multi-token prediction modules the transformers class does not build."""
    named = json.loads(source.hf_config).get("num_nextn_predict_layers") or 0 \
        if isinstance(source, ModelConfig) and source.hf_config else 0
    if named <= captured:
        return ()
    return (f"config.json names {named} multi-token prediction module(s) (num_nextn_predict_layers), which the "
            "transformers class does not build: not billed; a model YAML with mtp_layers bills them "
            "(docs/models.md)",)


def _stand_in_notes(source) -> tuple[str, ...]:
    """A config.json whose transformers class runs attention only eagerly, captured as the reference decoder."""
    name = eager_only_class(source) if isinstance(source, ModelConfig) else None
    if name is None:
        return ()
    return (f"transformers' {name} runs attention only eagerly (no SDPA) where the stack fuses it: captured as the "
            "reference decoder from config.json (docs/models.md), so fused attention is billed; what the reference "
            "decoder lacks (GPT-OSS's attention sinks, one logit per head) is not",)


def _front_end(top: str, kinds) -> str:
    used = {top, *(kind.front_end for kind in kinds)}
    return "recorded" if "recorded" in used else "torch.fx"


def _notes(parts: list[Measured]) -> tuple[str, ...]:
    notes: list[str] = []
    for part in parts:
        notes += [n for n in part.warnings if n not in notes]
    return tuple(notes)


def capture(model, seq_len: int | None = None, leaf_modules: tuple[str, ...] = (),
            attention_impl: str | None = None, fused_kernels: bool = False,
            fused_gated_activation: bool = False, dropout: float | None = None) -> ModelGraph:
    """Capture a model (built-in name, YAML, HF config, `file.py:factory`, ModelConfig or nn.Module).

    `attention_impl` ("flash" or "math"): how a model built from a config runs attention, as the software
    stack does it, unless the config names its own; a user module's own attention code is what it captures.
    `fused_kernels`: the stack runs every norm as one fused kernel (it keeps its input and fp32 statistics);
    else each norm's own code is measured op by op. `fused_gated_activation`: a gated activation's act(gate)
    is recomputed by its fused kernel, not stored (the stack field of that name). `dropout`: the probability a
    model built from a config that does not state one trains with (the stack's default; said in
    ModelGraph.assumed where it is not 0)."""
    with _CAPTURE_LOCK:
        return _capture(model, seq_len, leaf_modules, attention_impl, fused_kernels, fused_gated_activation, dropout)


# Capture is one at a time in a process: it imports a user's file and transformers' lazy modules, traces with
# global torch state (the meta device, torch.fx's patching) and fills a cache. The searches after it run in
# parallel threads as they like (each its own CP-SAT solver).
_CAPTURE_LOCK = threading.RLock()


def _capture(model, seq_len, leaf_modules, attention_impl, fused_kernels, fused_gated_activation,
             dropout) -> ModelGraph:
    source = resolve_model(model)
    if attention_impl is not None and isinstance(source, ModelConfig) \
            and "attention_impl" not in source.model_fields_set:
        source = source.model_copy(update={"attention_impl": attention_impl})
    assumed = ()
    if dropout and isinstance(source, ModelConfig) and "dropout" not in source.model_fields_set:
        source = source.model_copy(update={"dropout": dropout})
        assumed = (f"dropout {dropout:g} on hidden states and attention probabilities: the model does not state "
                   "it, the stack's default assumed (its masks billed; state `dropout: 0` for a model without)",)
    if seq_len is None and isinstance(source, UserModule):
        seq_len = source.seq_len   # a config.json built as transformers' class: its positions
    if seq_len is None:
        if not isinstance(source, ModelConfig):
            raise UserInputError("a user module needs a sequence length", field="seq_len",
                                 expected="seq_len=... (--seq-len on the CLI)")
        seq_len = source.seq_length
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= MAX_SEQ:
        raise UserInputError(f"{seq_len!r}", field="seq_len", expected=f"a positive integer sequence length up to {MAX_SEQ:,}")
    graph = _capture_cached(source, int(seq_len), tuple(leaf_modules), bool(fused_kernels),
                            bool(fused_gated_activation))
    return dataclasses.replace(graph, assumed=assumed) if assumed else graph
