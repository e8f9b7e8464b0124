"""Run by tests/test_capture.py in a process of its own (it starts a one-rank gloo group): the bytes
Megatron-Core's all-to-all token dispatcher moves in each of its steps on CPU, counted op by op under a
dispatch mode (views excluded), for T tokens of width h routed to k of E experts, all on this rank.
Prints a JSON object: step name -> bytes of tensors h wide read and written."""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

warnings.filterwarnings("ignore")


class Moved(TorchDispatchMode):
    """Bytes of the h-wide tensors every non-view op reads and writes."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.bytes = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if t.dim() >= 2 and t.shape[-1] == self.width)
        return out


def main(tokens: int, hidden: int, experts: int, topk: int) -> dict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    def host_copies(self, point, tokens_per_expert=None):
        """The dispatcher's own moves of its split sizes to host, without the CUDA stream CPU lacks."""
        if point == self.cuda_dtoh_point:
            tokens_per_expert = maybe_move_tensor_to_cpu(tokens_per_expert)
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                setattr(self, name, maybe_move_tensor_to_cpu(getattr(self, name), as_numpy=True))
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()   # made only where CUDA is
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_copies
    world = dist.group.WORLD
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts,
                               moe_router_topk=topk, moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
                               add_bias_linear=False)
    dispatcher = MoEAlltoAllTokenDispatcher(experts, list(range(experts)), config,
                                            pg_collection=ProcessGroupCollection(ep=world, expt_tp=world, tp_ep=world,
                                                                                 tp=world))
    torch.manual_seed(0)
    chosen = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)])
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.rand(tokens, experts) * routing
    moved = {}
    x = torch.randn(tokens, hidden)
    steps = (("permute", lambda: dispatcher.dispatch_preprocess(x, routing, probs)),
             ("all_to_all", lambda: dispatcher.token_dispatch(*state)),
             ("sort", lambda: dispatcher.dispatch_postprocess(*state)[::2]),
             ("unsort", lambda: (dispatcher.combine_preprocess(state[0]),)),
             ("all_to_all_back", lambda: (dispatcher.token_combine(state[0]),)),
             ("unpermute", lambda: (dispatcher.combine_postprocess(state[0]),)))
    state = ()
    for name, step in steps:
        with Moved(hidden) as mode:
            state = step()
        moved[name] = mode.bytes
    dist.destroy_process_group()
    return moved


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:5]))))
