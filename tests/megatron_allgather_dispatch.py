"""Run by tests/test_communication.py in a process of its own: Megatron-Core's all-gather token dispatcher
(MoEAllGatherTokenDispatcher) on two gloo ranks on CPU, one expert-parallel group of 2, with bf16 tokens
and probabilities (the router's default dtype). Records the full buffer of every all-gather and
reduce-scatter it makes (nccl-tests' S: the gathered output, the scattered input). Prints a JSON list of
[collective, bytes] from rank 0."""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")


def record(calls: list):
    """Wrap the two collectives Megatron-Core's mappings call, noting each full buffer; its buffers, which it
    allocates on the current CUDA device, go to the CPU (this process only)."""
    from megatron.core.tensor_parallel import mappings
    gather, scatter = mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func

    def all_gather_into_tensor(output, input, *args, **kwargs):
        calls.append(["all_gather", output.numel() * output.element_size()])
        return gather(output, input, *args, **kwargs)

    def reduce_scatter_tensor(output, input, *args, **kwargs):
        calls.append(["reduce_scatter", input.numel() * input.element_size()])
        return scatter(output, input, *args, **kwargs)

    mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = all_gather_into_tensor, reduce_scatter_tensor
    torch.cuda.current_device = lambda: "cpu"


def run(rank: int, tokens: int, hidden: int, experts: int, topk: int, port: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state._set_global_memory_buffer()   # the dispatcher gathers tokens into Megatron's global buffer
    world, alone = dist.group.WORLD, dist.new_group([rank], use_local_synchronization=True)
    calls: list = []
    record(calls)
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts,
                               moe_router_topk=topk, moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
                               add_bias_linear=False, expert_model_parallel_size=2)
    local = experts // 2
    dispatcher = MoEAllGatherTokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), config,
                                             pg_collection=ProcessGroupCollection(ep=world, expt_tp=alone,
                                                                                  tp_ep=world, tp=alone))
    torch.manual_seed(rank)
    chosen = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)])
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    probs = (torch.rand(tokens, experts) * routing).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    state = dispatcher.dispatch_preprocess(x, routing, probs)
    state = dispatcher.token_dispatch(*state)
    permuted, _, _ = dispatcher.dispatch_postprocess(*state)
    out = dispatcher.token_combine(dispatcher.combine_preprocess(permuted))
    dispatcher.combine_postprocess(out)
    if rank == 0:
        print(json.dumps(calls), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    tokens, hidden, experts, topk, port = sys.argv[1:6]
    mp.spawn(run, args=(int(tokens), int(hidden), int(experts), int(topk), port), nprocs=2)
