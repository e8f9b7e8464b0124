"""The job's process group, begun and ended the way every runtime script needs: under torchrun (a restarted
attempt on keys of its own), or as a one-rank group for the single-process reference; ended only once every
rank has finished talking (gloo aborts a process whose group is torn down while a peer still sends to it)."""
from __future__ import annotations

import gc
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from .watchdog import enable_flight_recorder

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def init_distributed(device_type: str = "cpu", timeout_s: float = 300.0) -> None:
    """One process group for the job: the backend of `device_type`, collectives that wait `timeout_s` at most
    for a peer (the watchdog then names the ranks lost), each rank on its LOCAL_RANK device."""
    if "RANK" not in os.environ:   # the single-process reference runs the same code on a one-rank group
        store = tempfile.mktemp(prefix="planner-ref-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        return
    enable_flight_recorder()   # each rank's last collectives, written when a peer is lost (watchdog)
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and hccl)
    if device_type != "cpu":
        getattr(torch, device_type).set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0":
        dist.init_process_group(BACKENDS[device_type], timeout=timeout)
        return
    # after a torchrun restart: keys of this attempt only (a dead attempt's addresses stay behind)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    dist.init_process_group(BACKENDS[device_type], store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def settle() -> None:
    """Every rank here before any goes on: the objects this rank dropped (a laid-out model's FSDP and mesh
    state, an optimizer) are freed while their groups still exist, and no rank tears a group down (or starts
    the next job) while a peer still talks to it."""
    gc.collect()
    dist.barrier()


def end_distributed() -> None:
    """After the caller dropped its models and optimizers: settle, then destroy the process group."""
    settle()
    dist.destroy_process_group()
