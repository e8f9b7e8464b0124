"""`StatedJob`: what a user states of a published job (the model by name, its devices, batch, sequence and
precision), shared by the benchmarks that predict published layouts through the plain path."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StatedJob:
    model: str           # a built-in model name
    device: str          # a device profile name
    num_devices: int
    global_batch: int
    seq_len: int
    precision: str

    def api_args(self) -> dict:
        """The keywords `planner.plan` and `planner.evaluate` take for the job (beside the model)."""
        return dict(device=self.device, num_devices=self.num_devices, global_batch=self.global_batch,
                    seq_len=self.seq_len, precision=self.precision)
