"""torch's PipelineStage, with FSDP2's parameters gathered before a split backward's input pass.

torch's `stage_backward_input` (torch/distributed/pipelining/_backward.py, torch 2.13) is handed the stage
module's parameters before autograd runs, so before FSDP2's pre-backward hook unshards them. Where FSDP2
resharded after the forward (ZeRO-3) and the input pass follows that forward directly, as DualPipeV runs its
loss chunk's first micro-batch (F, I, W), those are the sharded parameters: none is found in the graph, and
the weight pass computes no gradient for that micro-batch (the loss chunk's gradients 12-22% short at step 1
against one process; docs/runtime.md). Gathering them first makes the input pass see the parameters the
forward used; FSDP2's own pre-backward hook then finds them gathered, and torch's stage keeps them so until
the weight pass (it turns resharding after backward off).
"""
from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage


class GatheringPipelineStage(PipelineStage):
    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if not full_backward and isinstance(self.submod, FSDPModule):
            for module in self.submod.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                          last_backward=last_backward)
