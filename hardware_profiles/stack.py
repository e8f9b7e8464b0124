"""Software-stack profiles: what the training framework a user runs fuses, overlaps, holds and supports.

A stack is the fourth input beside model, cluster and layout (`--stack NAME|FILE`, `stack=` in the API).
Each built-in names its sources in comments (`hardware_profiles/stacks/*.yaml`). The search never proposes
what the stack cannot run (a degree, ZeRO stage, schedule, recomputation or FP8 recipe it lacks), the cost
models charge what it hides or exposes, and the memory model holds what it holds.

Overlaps (0 = exposed, 1 = hidden): with TP overlap the collectives run as tp chunked ring steps beside
the GEMMs, the first chunk exposed and the rest hidden where the layer's compute suffices
(`MeshCosts.tp_comm_s`); with MoE A2A overlap each layer's forward of one micro-batch runs beside its
backward of another, so each pass's all-to-alls hide behind the other's compute (`MeshCosts.ep_comm_s`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .schema import Strict
from .stack_overlaps import A2A_OVERLAP_DISPATCHER_RULE, A2A_OVERLAP_DISPATCHERS, StackOverlaps

DEFAULT_STACK = "megatron-core"
RUNTIME_STACK = "parallel-planner"   # what this project's runtime (runtime/) runs; it checks every plan against it

Axis = Literal["tp", "pp", "cp", "ep"]
Fp8RecipeName = Literal["delayed", "tensorwise", "mxfp8", "blockwise"]   # cost_models.layout.Fp8Recipe


# cost_models.layout.RecomputeModule's names (profiles do not import the cost models)
RecomputeModuleName = Literal["core_attn", "mlp", "moe", "layernorm", "mla_up_proj", "moe_act", "shared_experts"]
# plain all-to-all, DeepEP's one copy per destination domain, or Megatron-Core's default all-gather of every
# token to the expert tp x ep group (--moe-token-dispatcher-type allgather)
MoeDispatcher = Literal["alltoall", "deepep", "allgather"]

class HostCalls(Strict):
    """Host CPU time the framework spends issuing one call, in units of the node's `Device.host_call_us` (one
    torch.nn.Linear forward): a GEMM module's forward and backward, in BF16 and in FP8, and any other op's."""
    gemm_forward: float = Field(gt=0)
    gemm_backward: float = Field(gt=0)
    fp8_gemm_forward: float = Field(gt=0)
    fp8_gemm_backward: float = Field(gt=0)
    op_forward: float = Field(gt=0)
    op_backward: float = Field(gt=0)


class SoftwareStack(StackOverlaps, Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")   # goes into plan files and commands
    display_name: str = Field(min_length=1)

    # what it supports: the search never leaves these
    parallelism: tuple[Axis, ...] = Field(strict=False)   # model-parallel axes beside data parallelism
    # ZeRO stages: 0 = replicated, 1 = optimizer sharded, 2 = also gradients, 3 = also weights
    zero_stages: tuple[int, ...] = Field(min_length=1, strict=False)
    # the stages it runs where data-parallel ranks also hold tensor- or expert-parallel shards (none: every
    # one of zero_stages); this project's runtime shards them with FSDP2 there, ZeRO-2/3 only
    zero_stages_beside_model_parallel: tuple[int, ...] | None = Field(default=None, min_length=1, strict=False)
    interleaved_schedule: bool               # virtual pipeline stages (interleaved 1F1B)
    # the layers split evenly over the pp x vp chunks, the embedding and loss beside them (Megatron-LM before
    # --decoder-first/last-pipeline-num-layers asserts num_layers % pp == 0 and per-stage % vp == 0; DeepSpeed's
    # PipelineModule 'parameters' partition of equal layers); else any split the search balances
    even_pipeline_split: bool = False
    # DualPipeV: two chunks per pipeline rank placed as a V, a forward beside another micro-batch's backward
    # in the steady state (torch ScheduleDualPipeV; MindSpeed --schedules-method dualpipev)
    dualpipev_schedule: bool = False
    # its overlapped pairs hide each other's MoE all-to-alls (MindSpeed --moe-fb-overlap); false where the
    # pair runs one pass after the other (torch runs OVERLAP_F_B's sub-actions in turn unless a function is
    # registered for it)
    dualpipev_hides_moe_a2a: bool = False
    # the cooldown splits backward into input and weight gradients as the warm-up does (torch's action list;
    # MindSpeed only with --dualpipev-dw-detach): the bubble is (p - 1)(F + 2B - 3W) per chunk, else - W
    dualpipev_weight_split_in_cooldown: bool = True
    # layers a multiple of 2 pp, split evenly over the chunks (MindSpeed's DualPipeV), else any split
    dualpipev_even_split: bool = False
    dualpipev_beside_cp: bool = True         # DualPipeV and context parallelism together
    # recomputation inside DualPipeV: its split backward asks a checkpointed block for its saved tensors in two
    # passes (input, then weight gradients), which a checkpoint that recomputes once per forward cannot serve
    dualpipev_recompute: bool = True
    # its DualPipeV runs torch's split weight pass (stage_backward_weight: one autograd.grad per parameter group)
    # over non-reentrant checkpointing, which recomputes a region once per backward graph task: each split
    # backward recomputes a recomputed layer once more per parameter group (LayerKind.weight_pass_groups), and
    # selective checkpointing, which allows one backward per region, cannot run there
    dualpipev_weight_pass_recompute: bool = False
    # the ZeRO stages it runs DualPipeV with where gradients are reduced over more than one rank (dp x cp > 1;
    # none: all it runs); over one rank ZeRO 0 and 1 shard and reduce nothing, so they run too
    dualpipev_zero_stages: tuple[int, ...] | None = Field(default=None, min_length=1, strict=False)
    sequence_parallel: bool                  # Megatron sequence parallelism beside TP
    selective_recompute: bool                # recompute the attention core only (Korthikanti et al. 2022)
    # what its selective recomputation can repeat besides the attention core (Megatron-Core's
    # --recompute-modules); a layout naming others is refused
    recompute_modules: tuple[RecomputeModuleName, ...] = Field(default=("core_attn",), min_length=1, strict=False)
    per_layer_recompute: bool                # each layer its own method; else every layer checkpoints or none does
    # selective recomputation is one switch for the whole model: every layer or none, and then no layer
    # fully (Megatron-Core's --recompute-granularity takes one value, full or selective)
    selective_every_layer: bool = False
    fp8_recipes: tuple[Fp8RecipeName, ...] = Field(strict=False)   # first is the default; empty: no FP8 training
    # what an FP8 linear keeps of its input for backward: an FP8 copy (Transformer Engine's Linear saves its
    # quantised input) or the bf16 input (torchao's Float8Linear: matmul_with_hp_or_float8_args saves input_hp)
    fp8_saved_inputs: Literal["fp8", "bf16"] = "fp8"
    context_parallel_attention: Literal["any", "reference", "sdpa"]   # attention it can split by sequence:
    #                                        its own layers' ("any": the model is written for the framework),
    #                                        only the reference decoder's CoreAttention, or that and any causal
    #                                        scaled_dot_product_attention without a sliding window (this runtime)
    expert_parallel_experts: Literal["any", "stacked"]        # experts it can spread: any, or stacked weights
    #                                        with the reference MoE's route/routed protocol or in a module
    #                                        called with the routing (transformers 5.x experts)
    tensor_parallel_projections: Literal["any", "separate"]   # projections it can column-split: fused ones
    #                                        cut into parts by the model ([q | k | v]) too, or separate only
    pipeline_models: Literal["any", "traceable", "sequential"]  # models it cuts into pipeline stages: any (its
    #                                        own layers); those torch.fx traces (cut from the fx graph); or those
    #                                        too whose forward calls its block list in order (a stage runs the
    #                                        model's own forward over its blocks: runtime/sequential_stage.py)

    # what it fuses and overlaps (cost models)
    flash_attention: bool                    # fused attention: no s x s tensors stored, masked blocks skipped
    fused_kernels: bool                      # each norm and activation function is one kernel: a norm keeps its
    #                                          input and fp32 row statistics, an activation its input; false:
    #                                          the model's own code for them runs op by op, as written
    # a gated activation (SwiGLU, GeGLU: act(gate) * up) as one kernel that keeps its two inputs and
    # recomputes act(gate) in backward, so the product does not store it (Megatron-Core's bias_swiglu_impl)
    fused_gated_activation: bool = False
    # dropout (hidden and attention) on a model whose config does not state it: the framework's own default
    # (Megatron-LM's arguments.py: --hidden-dropout and --attention-dropout 0.1); 0 where the stack's models
    # train without. Its masks and the attention-probability copy it keeps are billed by capture (Korthikanti
    # et al. 2022 Table 2: sbh per mask, as^2b + 2as^2b under the attention dropout)
    model_dropout: float = Field(default=0.0, ge=0, lt=1)
    # the stack can run TP communication overlap (TP collectives as chunked rings beside the GEMMs: Megatron
    # --tp-comm-overlap, Transformer Engine userbuffers): whether a plan runs it is the search's choice per layout
    # (Layout.tp_comm_overlap), and evaluate's where a layout leaves it out; the exports write it where a plan does
    tp_comm_overlap: bool
    # the stack can run Megatron's combined 1F1B (MoE all-to-alls beside another micro-batch's compute): whether
    # a plan runs it is the search's choice per layout (Layout.moe_a2a_overlap), and evaluate's where a layout
    # leaves it out; the exports write the flags where a plan runs it
    moe_a2a_overlap: bool
    # MoE token dispatcher: a plain all-to-all (one copy per chosen expert), or DeepEP's deduplicated one
    # (one copy per destination scale-up domain, forwarded inside it: Megatron-Core
    # --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep)
    moe_dispatcher: MoeDispatcher = "alltoall"
    # whether the deduplicated dispatch sends FP8 tokens (one byte per channel, an fp32 scale per 128) when
    # training in FP8, as DeepSeek-V3's does (3.3.2); Megatron-Core's DeepEP and HybridEP dispatch the BF16
    # hidden states (transformer/moe/fused_a2a.py: FusedDispatch passes them as they are; HybridEP sets
    # fp8_dispatch False, "we do not support fp8 dispatch"), the combine is BF16 in both
    moe_fp8_dispatch: bool = False
    # the dispatchers it can run (the search chooses among them per layout where experts spread, DeepEP's only
    # on a device whose profile runs its kernels); `moe_dispatcher` is its default, where ep = 1 or none is chosen
    moe_dispatchers: tuple[MoeDispatcher, ...] = Field(default=("alltoall",), min_length=1, strict=False)
    # the shared experts beside the all-to-alls on a stream of their own (Megatron-Core --moe-shared-expert-overlap,
    # token_dispatcher.py: their up-projection beside the dispatch, the down-projection beside the combine,
    # forward and backward); alltoall dispatcher only, and not under combined 1F1B, as Megatron-Core requires
    moe_shared_expert_overlap: bool = False
    # SMs DeepEP's kernels occupy while they run (DeepSeek-V3 3.2.2: 20 SMs saturate IB and NVLink; Megatron-Core
    # moe_flex_dispatcher_num_sms, historical default 20): compute overlapped with them runs on the rest
    deepep_sms: int = Field(default=20, gt=0)
    # SMs HybridEP's kernels occupy, where the device runs the flex dispatcher as HybridEP (Megatron-Core
    # moe_hybridep_num_sms; None there: DeepEP's default, so `deepep_sms` unless a stack sets it)
    hybridep_sms: int | None = Field(default=None, gt=0)
    # copies of the routed tokens the all-to-all dispatcher makes beyond the permutation and combine every
    # dispatcher has, where a rank holds more than one expert: Megatron-Core sorts the received tokens by
    # local expert before the experts and back after them (token_dispatcher.py, MoEAlltoAllTokenDispatcher
    # "Permutation 2" / "Unpermutation 2", sort_chunks_by_idxs), 2; each reads and writes k tokens per token
    moe_sort_copies: int = Field(default=0, ge=0)
    # the routing probabilities multiply the experts' activation (a weighted SwiGLU on the intermediate
    # tensor) rather than their output: the h-wide expert output is then not kept for the probabilities'
    # gradient (Megatron-Core 0.13 CHANGELOG: "moving the probs multiplication from unpermutation to activation
    # function of GroupedMLP"; experts.py weighted_bias_swiglu_impl, already in core_v0.12.1's). False: the
    # output is multiplied and kept
    moe_probs_in_expert_activation: bool = False
    # trains a model's multi-token prediction modules (Megatron-Core --mtp-num-layers, since 0.12)
    multi_token_prediction: bool = False
    # host time per call (cost_models/host_time.py): a pass takes the longer of the device's work and the host's
    # issuing of it; None: not billed
    host_calls: HostCalls | None = None
    # column-parallel projections that read one input run as one GEMM call (Megatron's linear_qkv, linear_fc1)
    fused_projections: bool = False
    # a rank's local experts run as one grouped call per projection (Megatron-Core --moe-grouped-gemm, torch's
    # grouped_mm), each further expert one op's host time; else one GEMM call per expert
    grouped_experts: bool = True
    # layers replayed as CUDA graphs: their host time is one replay, not billed
    cuda_graphs: bool = False
    # what the graphs hold: whole layers, or each layer's attention and, in MoE layers, the router and the
    # dispatcher's preprocessing (Megatron-Core --cuda-graph-impl transformer_engine --cuda-graph-scope attn
    # moe_router moe_preprocess, what a dropless MoE can graph): the rest is issued by the host
    cuda_graph_scope: Literal["layers", "attention_and_router"] = "layers"
    # where the MoE dispatcher copies the routed token counts to the host in each MoE layer's forward, before the
    # experts: the host stops running ahead there (cost_models/host_time.py). always: Megatron-Core's alltoall
    # dispatcher unless it pads to capacity (token_dispatcher.py cuda_sync_point "before_ep_alltoall", or
    # "before_finish" with one local expert); spread: only with experts spread (ep > 1: an all-to-all whose
    # split sizes the host reads, torchtitan's ExpertParallel); never
    moe_dispatch_host_sync: Literal["never", "spread", "always"] = "never"
    dp_window_fraction: float = Field(ge=0, le=1)   # share of the last backward that hides the DP reduction
    cp_hidden: float = Field(ge=0, le=1)     # share of the CP ring exchange hidden behind attention
    pp_hidden: float = Field(ge=0, le=1)     # share of pipeline sends hidden behind compute
    # the same under the interleaved schedule, where a chunk's sends can run beside the next chunk's compute
    # (Megatron-Core --overlap-p2p-communication, on by default there and off without virtual stages)
    pp_hidden_interleaved: float = Field(default=0.0, ge=0, le=1)
    causal_attention_work: float = Field(gt=0, le=1)  # share of s x s work a causal fused kernel does

    # what it holds (memory model)
    gradient_reduce: Literal["fp32", "bf16"]             # gradient buffers and reductions, unless the layout says
    master_weights: Literal["separate", "parameters"]    # bf16 weights beside an fp32 master in the optimizer,
    #                                                      or fp32 parameters that are the master (cast per use)
    # Megatron-Core's precision-aware optimizer (--use-precision-aware-optimizer: Transformer Engine's FusedAdam,
    # megatron/core/optimizer/__init__.py), off, on, or on where the run computes in BF16 (what Megatron-Bridge's
    # and NeMo 2's performance scripts do). Where TE holds the master (BF16, or FP8 with delayed scaling) it
    # keeps the fp32 master as the 16 bits its bf16 weight lacks (store_param_remainders, with TE >= 2.1);
    # `adam_moment_bytes`: each of exp_avg and exp_avg_sq in fp32 (4) or bf16 (2: --exp-avg-dtype bf16
    # --exp-avg-sq-dtype bf16, which need it on)
    precision_aware_optimizer: Literal["off", "bf16", "on"] = "off"
    adam_moment_bytes: Literal[2, 4] = 4
    gradient_buffer: Literal["persistent", "per_step"]   # allocated once and held, or allocated by backward
    # ZeRO stages whose gradients live in a buffer allocated once whatever `gradient_buffer` says (DDP's reduction
    # buckets, which gradient_as_bucket_view makes the gradients)
    persistent_gradient_zero_stages: tuple[int, ...] = Field(default=(), strict=False)
    # under pipelining, how ZeRO-2/3 gradients accumulate over a step's micro-batches: reduce-scattered after each
    # ("sharded") or kept unsharded (ZeRO-2's unsharded parameters too) and reduced once after the last ("unsharded":
    # torch.distributed.pipelining runs every backward with FSDP2's requires_gradient_sync and
    # reshard_after_backward off, and reduces in the stage's perform_reduce_grad)
    pipeline_gradient_accumulation: Literal["sharded", "unsharded"] = "sharded"
    # ZeRO-2 frees each module's unsharded parameters after its backward (FSDP's reshard after backward), so every
    # micro-batch's forward all-gathers them again, not the step once, except where gradients accumulate unsharded
    # under pipelining, which keeps them to the step's end
    zero2_gathers_per_micro_batch: bool = False
    # how ZeRO-3 issues its per-micro-batch gathers and reduce-scatters: a module's tensors in one collective each
    # way ("coalesced": FSDP2's foreach all-gather and reduce-scatter per module), or one collective per parameter
    # tensor, each paying a collective's latency ("per_tensor": DeepSpeed v0.3.15 partition_parameters.py
    # _allgather_param and _reduce_scatter_gradient, one torch.distributed call per parameter)
    zero3_collectives: Literal["coalesced", "per_tensor"] = "coalesced"
    # whether ZeRO-3's traffic runs beside compute (a collective stream the compute stream does not wait on), or
    # between it, where fetching a module's parameters blocks the host until the device is idle (DeepSpeed v0.3.15
    # stage3.py fetch_sub_module, "This call is blocking": _synchronize_communication calls
    # torch.cuda.synchronize(), as _allgather_param does before each parameter), so no compute is queued beside it
    zero3_traffic_hidden: bool = True
    # under full recomputation, whether a module's parameters gathered for its recomputed forward are kept for its
    # backward: None, kept (FSDP2 and Megatron FSDP gather once for both); N, kept only where fewer than N parameters
    # are fetched in between, else gathered again (DeepSpeed's stage3_max_reuse_distance, 1e9 by default in v0.3.15
    # zero/constants.py; stage3.py release_sub_module and _keep_for_later)
    zero3_reuse_distance_params: float | None = Field(default=None, gt=0)
    # cross-entropy backward: into its saved fp32 softmax, two new fp32 buffers of the logits' size, or into
    # the bf16 logits a fused kernel keeps (Megatron-Core --cross-entropy-fusion-impl te; cost_models/memory.py)
    loss_gradient: Literal["in_place", "eager", "fused"]
    # 0: the optimizer's fp32 states stay in device memory; N: they live in host memory and come to the device
    # N chunks at a time for the update, each chunk copied in and back out (MindSpeed --swap-optimizer,
    # torchtitan-npu optimizer.swap_optimizer with swap_optimizer_times = N); needs the device's host link
    optimizer_swap_chunks: int = Field(default=0, ge=0)
    # can offload the saved activations of the first N layers to host memory (Megatron-Core
    # --cpu-offloading-num-layers, Transformer Engine's CPU offload context): a searched plan field
    # (Layout.offload_layers) at pp = 1 without recomputation, over the device's host link
    activation_offload: bool = False

    @model_validator(mode="after")
    def _valid_sets(self):
        if any(z not in (0, 1, 2, 3) for z in self.zero_stages):
            raise ValueError(f"zero_stages {list(self.zero_stages)}: stages are 0 to 3")
        if len(set(self.zero_stages)) != len(self.zero_stages) or len(set(self.parallelism)) != len(self.parallelism):
            raise ValueError("zero_stages and parallelism list each entry once")
        if not set(self.zero_stages_beside_model_parallel or ()) <= set(self.zero_stages):
            raise ValueError(f"zero_stages_beside_model_parallel {list(self.zero_stages_beside_model_parallel)}: "
                             f"each must be one of zero_stages {list(self.zero_stages)}")
        if self.sequence_parallel and "tp" not in self.parallelism:
            raise ValueError("sequence_parallel needs tp in parallelism")
        if self.interleaved_schedule and "pp" not in self.parallelism:
            raise ValueError("interleaved_schedule needs pp in parallelism")
        if self.dualpipev_schedule and "pp" not in self.parallelism:
            raise ValueError("dualpipev_schedule needs pp in parallelism")
        if self.dualpipev_zero_stages is not None and not (
                self.dualpipev_schedule and set(self.dualpipev_zero_stages) <= set(self.zero_stages)):
            raise ValueError(f"dualpipev_zero_stages {list(self.dualpipev_zero_stages)}: needs dualpipev_schedule, "
                             f"and each must be one of zero_stages {list(self.zero_stages)}")
        if not set(self.persistent_gradient_zero_stages) <= set(self.zero_stages):
            raise ValueError(f"persistent_gradient_zero_stages {list(self.persistent_gradient_zero_stages)}: each must "
                             f"be one of zero_stages {list(self.zero_stages)}")
        if self.dualpipev_weight_pass_recompute and not (self.dualpipev_schedule and self.dualpipev_recompute):
            raise ValueError("dualpipev_weight_pass_recompute needs dualpipev_schedule and dualpipev_recompute")
        if self.dualpipev_hides_moe_a2a and not self.dualpipev_schedule:
            raise ValueError("dualpipev_hides_moe_a2a needs dualpipev_schedule")
        if self.moe_dispatcher not in self.moe_dispatchers:
            raise ValueError(f"moe_dispatcher {self.moe_dispatcher}: the default must be one of moe_dispatchers "
                             f"{list(self.moe_dispatchers)}")
        if self.moe_shared_expert_overlap and "alltoall" not in self.moe_dispatchers:
            raise ValueError("moe_shared_expert_overlap needs alltoall among moe_dispatchers: Megatron-Core's "
                             "TransformerConfig runs it with the alltoall dispatcher only")
        if self.moe_a2a_overlap and not set(self.moe_dispatchers) & set(A2A_OVERLAP_DISPATCHERS):
            raise ValueError("moe_a2a_overlap needs alltoall or deepep among moe_dispatchers: "
                             + A2A_OVERLAP_DISPATCHER_RULE)
        if self.precision_aware_optimizer != "off" and self.master_weights != "separate":
            raise ValueError("precision_aware_optimizer needs master_weights: separate (bf16 weights beside a master)")
        if self.adam_moment_bytes != 4 and self.precision_aware_optimizer != "on":
            raise ValueError("adam_moment_bytes 2 (bf16 moments) needs precision_aware_optimizer: on, as "
                             "Megatron-Core's OptimizerConfig does")
        return self

    def gradient_buffer_in(self, layout) -> str:
        """Where `layout`'s gradients live: `gradient_buffer`, or a persistent buffer at the stages that keep one."""
        return "persistent" if layout.zero in self.persistent_gradient_zero_stages else self.gradient_buffer

    def accumulates_unsharded(self, layout) -> bool:
        """Whether ZeRO-2/3 gradients stay unsharded through the step and are reduced once, after the last
        micro-batch (`pipeline_gradient_accumulation` under pipelining)."""
        return self.pipeline_gradient_accumulation == "unsharded" and layout.pp > 1 and layout.zero >= 2

    def gathers_per_micro_batch(self, layout) -> bool:
        """Whether ZeRO-2 all-gathers the parameters for every micro-batch's forward (`zero2_gathers_per_micro_batch`),
        rather than once a step after the optimizer."""
        return self.zero2_gathers_per_micro_batch and layout.zero == 2 and not self.accumulates_unsharded(layout)

    def saved_input_precision(self, precision) -> str:
        """The precision whose saved tensors the activation memory bills: fp8 only where FP8 layers keep FP8 copies
        of their GEMM inputs (`fp8_saved_inputs`)."""
        return "bf16" if precision == "fp8" and self.fp8_saved_inputs == "bf16" else str(precision)

    def moment_bytes_in(self, layout) -> int:
        """Bytes of each Adam moment `layout` keeps: the stack's where the precision-aware optimizer runs, fp32
        otherwise (Megatron-Core's OptimizerConfig allows no other dtype without it)."""
        return self.adam_moment_bytes if self.precision_aware_in(layout) else 4

    def precision_aware_in(self, layout) -> bool:
        """Whether the precision-aware optimizer runs for `layout`: in its precision, and with the distributed
        optimizer, which Megatron-Core's OptimizerConfig requires (ZeRO-1; Megatron-Bridge turns it off under
        Megatron FSDP, ZeRO-2/3 here: scripts/performance/utils/helpers.py set_megatron_fsdp_overrides)."""
        precision = self.precision_aware_optimizer == "on" or (
            self.precision_aware_optimizer == "bf16" and layout.precision == "bf16")
        return precision and layout.zero == 1

    def zero_stages_for(self, dp: int, tp: int, ep: int, dualpipev: bool = False) -> tuple[int, ...]:
        """The ZeRO stages it runs for these degrees (`dp`: the ranks gradients are reduced over, dp x cp) and
        schedule."""
        stages = self.zero_stages
        if dp > 1 and (tp > 1 or ep > 1) and self.zero_stages_beside_model_parallel is not None:
            stages = tuple(z for z in stages if z in self.zero_stages_beside_model_parallel)
        if dualpipev and self.dualpipev_zero_stages is not None:
            allowed = set(self.dualpipev_zero_stages) | ({0, 1} if dp == 1 else set())
            stages = tuple(z for z in stages if z in allowed)
        return stages

    def summary(self) -> str:
        """One line for plan output: the stack and what it changes in the prediction."""
        held = "gradients held across steps" if self.gradient_buffer == "persistent" else "gradients per step"
        extras = [f for f, on in (("flash attention", self.flash_attention), ("SP", self.sequence_parallel),
                                  ("TP overlap", self.tp_comm_overlap), ("MoE A2A overlap", self.moe_a2a_overlap),
                                  ("optimizer states swapped to host", self.optimizer_swap_chunks > 0))
                  if on]
        return f"{self.name} ({', '.join(extras) or 'no fused attention or overlaps'}; {self.gradient_reduce} " \
               f"gradients, {held})"
