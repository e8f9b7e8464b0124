"""What each step measurably cost, per rank, beside what the plan predicted: JSON lines that
`planner calibrate --telemetry DIR` reads (planner/calibration.py).

Each rank writes `DIR/rank-R.jsonl`. The first line is the header: the plan's model, cluster, device,
layout and predicted parts (its `breakdown`, seconds); then one line per trained step:

    {"step": 7, "rank": 0, "step_s": ..., "forward_backward_s": ..., "checks_s": ..., "optimizer_s": ...,
     "checkpoint_blocking_s": ..., "forward_compute_s": ... (on the steps the straggler timer ran),
     "tp_comm_s": ..., "pipeline_bubble_s": ..., ..., "compute_s": ... (on the steps the communication
     recorder ran; compute_s is forward_backward_s less the exposed parts)}

forward_backward_s runs from the step's start to its gradients being complete (the forward, the
backward, the exposed collectives inside them, the pipeline's bubble); checks_s is the health checks'
time with the loss's all-reduce (which carries their non-finite flag); optimizer_s the optimizer step
(and clipping). On an accelerator the stopwatch synchronises the device at each mark, so the parts are
device time, not launch time. On every N-th step (`--telemetry-comm-every`) the exposed communication
inside forward_backward_s is split by kind and the pipeline's waits measured, under the names of the
plan's breakdown (runtime/comm_telemetry.py).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .comm_telemetry import ExposedComm


@dataclass(frozen=True)
class StepTiming:
    forward_backward_s: float
    checks_s: float
    optimizer_s: float
    forward_compute_s: float | None = None   # leaf modules' forward, on steps the straggler timer ran
    exposed_comm: ExposedComm | None = None  # by kind, inside forward_backward_s, on steps the recorder ran

    @property
    def step_s(self) -> float:
        return self.forward_backward_s + self.checks_s + self.optimizer_s


class Stopwatch:
    """Seconds between marks of one step, summed per part."""

    def __init__(self, device: torch.device):
        self.sync = getattr(torch, device.type).synchronize if device.type != "cpu" else None
        self.last = time.perf_counter()
        self.parts: dict[str, float] = {"forward_backward_s": 0.0, "checks_s": 0.0, "optimizer_s": 0.0}

    def mark(self, part: str) -> None:
        if self.sync:
            self.sync()
        now = time.perf_counter()
        self.parts[part] += now - self.last
        self.last = now

    def timing(self, forward_compute_s: float | None, exposed_comm: ExposedComm | None = None) -> StepTiming:
        return StepTiming(forward_compute_s=forward_compute_s, exposed_comm=exposed_comm, **self.parts)


@dataclass(frozen=True)
class TelemetryHeader:
    model: str
    cluster: str
    device: str
    num_devices: int
    layout: str
    predicted_step_s: float | None
    predicted: dict            # the plan's breakdown: part name -> seconds (empty without a plan)
    plan: dict | None = None   # the plan itself (its JSON), so that a refit can predict the same job again
    model_source: str = ""     # the model as the job was given it (a built-in name or a file): captured again


class TelemetryWriter:
    def __init__(self, directory: str, rank: int, header: TelemetryHeader):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rank-{rank}.jsonl"
        self.rank = rank
        self.file = self.path.open("w")
        self.file.write(json.dumps({"header": asdict(header)}) + "\n")

    def write(self, step: int, timing: StepTiming, checkpoint_blocking_s: float) -> None:
        record = {"step": step, "rank": self.rank, "step_s": timing.step_s + checkpoint_blocking_s,
                  "forward_backward_s": timing.forward_backward_s, "checks_s": timing.checks_s,
                  "optimizer_s": timing.optimizer_s, "checkpoint_blocking_s": checkpoint_blocking_s}
        if timing.forward_compute_s is not None:
            record["forward_compute_s"] = timing.forward_compute_s
        if timing.exposed_comm is not None:   # and the rest of forward+backward: this rank's own compute
            exposed = asdict(timing.exposed_comm)
            record.update(exposed, compute_s=timing.forward_backward_s - sum(exposed.values()))
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
