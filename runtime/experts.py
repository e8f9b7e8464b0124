"""Expert parallelism: routed experts sharded over an `ep` group, tokens dispatched and combined with
`all_to_all_single` (uneven splits, autograd through the functional collectives).

Applies to MoE modules with stacked expert weights (`num_experts` rows) that follow the reference protocol
(`route`, `routed`, as `planner.reference_model.MoE`), or whose experts module is called with the routing,
(tokens, expert index, routing weight), as transformers 5.x's are. The ep group folds over the data-parallel
ranks; with ep < dp the remaining factor is an expert-data-parallel group whose gradients are summed.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from planner.graph_capture.graph import ModelGraph
from planner.graph_capture.expert_structure import indexed_experts
from planner.graph_capture.module_kinds import routed_experts
from planner.graph_capture.reference_model import activate

from .dims import local_shard


def expert_meshes(world: DeviceMesh, ep: int, etp: int = 1) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None]:
    """Split the dp dim of the world mesh into (edp, ep), ep innermost: ep ranks are neighbours in dp.
    With etp > 1 the tp dim serves as etp: also returns the 2-D (ep, etp) mesh the expert weights use."""
    names = list(world.mesh_dim_names)
    index = names.index("dp")
    ranks = world.mesh
    shape = list(ranks.shape)
    dp = shape[index]
    shape[index:index + 1] = [dp // ep, ep]
    names[index:index + 1] = ["edp", "ep"]
    names = ["etp" if n == "tp" and etp > 1 else n for n in names]
    mesh = DeviceMesh(world.device_type, ranks.reshape(shape), mesh_dim_names=tuple(names))
    return mesh["ep"], mesh["edp"], (mesh["ep", "etp"] if etp > 1 else None)


def _splits(counts: torch.Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


def _ep_routed(self, tokens, weights, chosen):
    """Dispatch each (token, expert) pair to the expert's rank, run local experts, combine back."""
    group = self._ep_group
    ep, local = self._ep_size, self.num_experts // self._ep_size
    first = self._ep_rank * local
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // self.top_k
    expert_sorted = flat[order]
    send = torch.bincount(expert_sorted // local, minlength=ep)
    recv = funcol.all_to_all_single(send, [1] * ep, [1] * ep, group).wait()
    send_splits, recv_splits = _splits(send), _splits(recv)
    x_recv = funcol.all_to_all_single_autograd(tokens[token_of], recv_splits, send_splits, group)
    e_recv = funcol.all_to_all_single(expert_sorted, recv_splits, send_splits, group).wait() - first
    w_up, w_down = self.experts.w_up.to_local(), self.experts.w_down.to_local()
    w_gate = self.experts.w_gate.to_local() if self.experts.w_gate is not None else None
    if self._etp_mesh is not None:  # the etp ranks share these tokens: their input gradients are partial sums
        x_recv = DTensor.from_local(x_recv, self._etp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
    y_recv = torch.zeros_like(x_recv)
    for e in range(local):
        rows = torch.nonzero(e_recv == e).flatten()
        if rows.numel():
            y_recv = y_recv.index_add(0, rows, _expert(self.experts.activation, x_recv[rows], w_up[e],
                                                      None if w_gate is None else w_gate[e], w_down[e]))
    if self._etp_mesh is not None:  # each etp rank holds a slice of every expert's ffn: sum the partials
        y_recv = DTensor.from_local(y_recv, self._etp_mesh, [Partial()]).redistribute(
            placements=[Replicate()]).to_local()
    y_back = funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)
    scale = weights.reshape(-1)[order][:, None]
    return torch.zeros_like(tokens).index_add(0, token_of, y_back * scale)


def _ep_indexed(self, tokens, expert_index, weights):
    """An experts module called with the routing (transformers): the same dispatch and combine, the
    module's own code run on the tokens this rank received, with their local expert index, its weights
    this rank's shard (weights of one: the routing weights are applied after the combine)."""
    if getattr(self, "_ep_inside", False):
        return type(self).forward(self, tokens, expert_index, weights)
    group, ep = self._ep_group, self._ep_size
    local = self._ep_num_experts // ep
    top_k = expert_index.shape[-1]
    flat = expert_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    expert_sorted = flat[order]
    send = torch.bincount(expert_sorted // local, minlength=ep)
    recv = funcol.all_to_all_single(send, [1] * ep, [1] * ep, group).wait()
    send_splits, recv_splits = _splits(send), _splits(recv)
    x_recv = funcol.all_to_all_single_autograd(tokens[token_of], recv_splits, send_splits, group)
    e_recv = funcol.all_to_all_single(expert_sorted, recv_splits, send_splits, group).wait() - self._ep_rank * local
    shards = {name: param.to_local() for name, param in self.named_parameters(recurse=False)
              if isinstance(param, DTensor)}
    counts = {name: getattr(self, name) for name in self._ep_count_attributes}
    self._ep_inside = True
    vars(self).update({name: local for name in counts})   # its code sizes by the experts it holds
    try:
        y_recv = torch.func.functional_call(self, shards, (x_recv, e_recv[:, None], torch.ones_like(
            e_recv[:, None], dtype=x_recv.dtype)))
    finally:
        self._ep_inside = False
        vars(self).update(counts)
    y_back = funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)
    scale = weights.reshape(-1)[order][:, None].to(y_back.dtype)
    return torch.zeros_like(tokens).index_add(0, token_of, y_back * scale)


def _expert(activation: str, x, w_up, w_gate, w_down):
    return activate(activation, x @ w_up, x @ w_gate if w_gate is not None else None) @ w_down


def _placements(name: str, etp: bool) -> list:
    """Experts over ep (dim 0); with expert tensor parallelism the ffn dim too: columns of the up and
    gate projections (dim 2), rows of the down projection (dim 1)."""
    if not etp:
        return [Shard(0)]
    return [Shard(0), Shard(1 if "down" in name else 2)]


def apply_ep(module: nn.Module, graph: ModelGraph, ep_mesh: DeviceMesh,
             expert_mesh: DeviceMesh | None = None) -> list[nn.Parameter]:
    """Shard the routed experts of every MoE block over `ep_mesh` (and the ffn dim over the etp dim of
    `expert_mesh`, an (ep, etp) mesh); returns the expert parameters."""
    params = []
    names = {name for name, _ in module.named_modules()}
    for slot in graph.blocks:
        structure = graph.structure(slot.kind)
        if not structure.expert_container or slot.module_name not in names:
            continue
        moe = module.get_submodule(f"{slot.module_name}.{structure.expert_container}")
        found = routed_experts(moe)
        indexed = indexed_experts(moe)
        if found is None or found.module_list is not None or not (hasattr(moe, "routed") or indexed is not None):
            raise ValueError(f"{slot.module_name}.{structure.expert_container}: expert parallelism needs stacked "
                             "expert weights, with the route/routed protocol of planner.reference_model.MoE or "
                             "in a module called with (tokens, expert index, routing weight)")
        if indexed is not None and expert_mesh is not None:
            raise ValueError(f"{slot.module_name}.{structure.expert_container}: expert tensor parallelism (etp > 1) "
                             "splits only the reference MoE's experts; run this model's experts with etp=1")
        for sub in moe.modules():
            for pname, param in list(sub.named_parameters(recurse=False)):
                if id(param) in found.param_ids:
                    mesh = expert_mesh if expert_mesh is not None else ep_mesh
                    sharded = nn.Parameter(distribute_tensor(param.data, mesh, _placements(pname, expert_mesh is not None)))
                    setattr(sub, pname, sharded)
                    params.append(sharded)
        owner = moe if indexed is None else indexed
        owner._ep_group, owner._ep_size, owner._ep_rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
        if indexed is None:
            moe._etp_mesh = expert_mesh["etp"] if expert_mesh is not None else None
            moe.routed = types.MethodType(_ep_routed, moe)
        else:
            indexed._ep_num_experts = found.count
            indexed._ep_count_attributes = [name for name, value in vars(indexed).items() if "expert" in name
                                            and isinstance(value, int) and value == found.count]
            indexed.forward = types.MethodType(_ep_indexed, indexed)
    return params


def finish_expert_grads(params: list[nn.Parameter], edp_mesh: DeviceMesh, dp_total: int) -> None:
    """Expert gradients sum the losses of the ep group's ranks; the objective averages over every
    data-parallel rank: sum over the expert-data-parallel replicas, divide by dp."""
    for param in params:
        if param.grad is None:
            continue
        grad = local_shard(param.grad)
        if edp_mesh.size() > 1:
            dist.all_reduce(grad, group=edp_mesh.get_group())
        grad.div_(dp_total)
