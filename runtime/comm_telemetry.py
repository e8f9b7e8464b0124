"""Exposed communication by kind, measured: the seconds a rank's training thread is held by each
parallelism's collectives inside forward+backward, named as the plan's breakdown names them
(cost_models/step_time.StepBreakdown), so that `planner calibrate` sets each beside its prediction.

What counts as exposed is the time the thread is blocked: in a collective's call (its launch, or the whole
collective where the backend runs it synchronously) and in the wait for its result - `Work.wait()` from
Python (FSDP2, pipelining, `dist.*`), the functional collectives' `wait_tensor` (DTensor, the expert
all-to-all, context-parallel gathers) and an `AsyncCollectiveTensor` used before it was waited on. A
collective waited on in C++ (the DDP reducer's gradient buckets, at the end of backward) is counted from its
completion: the time it finished after the last such collective of the step was launched (on the CPU; on an
accelerator such waits are stream dependencies made in C++, not seen). On an accelerator a wait holds the
current stream rather than the thread, and is timed by a pair of events around it on that stream: the
stream's stall until the collective is done (not run on a GPU in these sessions).

A pipeline's sends and receives wait for the neighbouring stage (a send completes when its receive is
posted): all their waits are `pipeline_bubble_s`, the schedule's idle time with the hops' transfers inside
it (the plan's `pipeline_bubble_s` plus `pp_comm_s`; one side cannot tell the two apart). Gradient
reductions over the data-parallel group are `dp_comm_s` under ZeRO-0/1 and `zero_comm_s` under ZeRO-2/3
(with the parameter all-gathers), as the cost model splits them. A group the mesh does not name is
`other_comm_s`.

The recorder is a `TorchDispatchMode`: every operator passes through Python while it is armed (about 4% of
a matrix-bound CPU step, more on a tiny model's), so it is armed on every N-th step only and the record of
such a step says so; the other steps time the parts without it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

IN_FLIGHT_KEPT = 64   # functional collectives remembered until waited on (one waited in C++ is never seen)


@dataclass(frozen=True)
class ExposedComm:
    """Seconds one rank's training thread was held by each kind of communication in one step."""
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    zero_comm_s: float = 0.0
    pipeline_bubble_s: float = 0.0   # with the hops' transfers: the plan's pipeline_bubble_s + pp_comm_s
    dp_comm_s: float = 0.0
    other_comm_s: float = 0.0

    @staticmethod
    def parts() -> tuple[str, ...]:
        return tuple(f.name for f in fields(ExposedComm))


@dataclass(frozen=True)
class GroupKinds:
    """Which part each process group's collectives are charged to, by the group's ranks (a DTensor may carry
    an earlier mesh's group over the same ranks, under another name)."""
    by_ranks: tuple[tuple[tuple[int, ...], str], ...]     # (the group's ranks, part)

    @classmethod
    def of(cls, groups: dict, zero: int) -> "GroupKinds":
        """`groups`: mesh dimension -> process group (dp, dp_cp, edp, tp, cp, ep, pp, as the runtime has them)."""
        gradient_part = "zero_comm_s" if zero >= 2 else "dp_comm_s"
        part_of_dim = {"tp": "tp_comm_s", "cp": "cp_comm_s", "ep": "ep_comm_s", "pp": "pipeline_bubble_s",
                       "dp": gradient_part, "dp_cp": gradient_part, "edp": gradient_part}
        return cls(tuple((tuple(dist.get_process_group_ranks(group)), part_of_dim[dim])
                         for dim, group in groups.items() if dim in part_of_dim))

    def part(self, ranks: tuple[int, ...] | None, op_name: str) -> str:
        parts = [part for of, part in self.by_ranks if of == ranks]
        if not parts:
            return "other_comm_s"
        if "ep_comm_s" in parts:   # ep over all of dp: the all-to-all is the experts', the rest gradients'
            others = [part for part in parts if part != "ep_comm_s"]
            return "ep_comm_s" if op_name.startswith("all_to_all") or op_name.startswith("alltoall") or not others \
                else others[0]
        part = parts[0]
        if part == "pipeline_bubble_s" and not (op_name == "send" or op_name.startswith("recv")):
            return "dp_comm_s"   # a collective over the pipeline group: the tied embeddings' gradient sum
        return part


def _group_ranks(func, args) -> tuple[int, ...] | None:
    """The ranks of the process group a c10d operator (a group object) or a functional one (its name) runs on."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
        if isinstance(arg, str) and func.namespace == "_c10d_functional":   # a group's name, or a reduce op's
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(arg)))
            except (ValueError, KeyError, RuntimeError):
                continue
    return None


class CommRecorder(TorchDispatchMode):
    """Armed around one step's forward+backward: `with recorder: ...`, then `recorder.exposed()`."""

    def __init__(self, kinds: GroupKinds, device_type: str = "cpu"):
        super().__init__()
        self.kinds = kinds
        # on an accelerator a wait holds the current stream, not the thread: it is timed by a pair of events
        # on that stream (the stream's stall until the collective's stream is done), read at the step's end
        self.on_stream = device_type != "cpu"
        self.stream_spans: list[tuple[str, object, object]] = []   # (part, event before, event after)
        self.seconds: dict[str, float] = {}
        self.works: dict[int, tuple[str, object]] = {}      # id(Work) -> (part, Work), until waited from Python
        self.in_flight: list[tuple[int, str]] = []          # (id(functional collective's output), part), oldest first
        self.launched: dict[int, float] = {}                # id(Work) -> when it was launched
        self.completed: dict[int, float] = {}               # id(Work) -> when it completed (set by the backend)
        self._wait = None

    # -- arming: the mode, and Work.wait timed while it is on --------------------------------------------
    def __enter__(self):
        self.seconds, self.works, self.launched, self.completed, self.in_flight = {}, {}, {}, {}, []
        self.stream_spans = []
        self._wait = dist.Work.wait
        recorder, original = self, self._wait

        def timed_wait(work, *args, **kwargs):
            began = recorder._begin()
            try:
                return original(work, *args, **kwargs)
            finally:
                entry = recorder.works.pop(id(work), None)
                if entry is not None:
                    recorder._end(entry[0], began)
        dist.Work.wait = timed_wait
        return super().__enter__()

    def __exit__(self, *exc):
        dist.Work.wait = self._wait
        return super().__exit__(*exc)

    def exposed(self) -> ExposedComm:
        for part, before, after in self.stream_spans:
            after.synchronize()
            self._add(part, before.elapsed_time(after) / 1e3)   # milliseconds
        self.stream_spans = []
        seconds = dict(self.seconds)
        for part in {part for part, _ in self.works.values()}:   # waited in C++: what ran past the last launch
            keys = [key for key, (of, _) in self.works.items() if of == part and key in self.completed]
            if keys:
                last_launch = max(self.launched[key] for key in keys)
                seconds[part] = seconds.get(part, 0.0) + max(0.0, max(self.completed[key] for key in keys)
                                                             - last_launch)
        return ExposedComm(**seconds)

    def _add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def _begin(self):
        if not self.on_stream:
            return time.perf_counter()
        event = torch.Event(enable_timing=True)
        event.record()
        return event

    def _end(self, part: str, began) -> None:
        if not self.on_stream:
            self._add(part, time.perf_counter() - began)
            return
        event = torch.Event(enable_timing=True)
        event.record()
        self.stream_spans.append((part, began, event))

    # -- every operator while armed ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._wait_inputs(args)
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        start = time.perf_counter()
        began = self._begin()
        out = func(*args, **kwargs)
        op_name = func._opname
        if op_name == "wait_tensor":
            self._end(self._waited(args[0]), began)
            return out
        if op_name.startswith("_wrap_tensor"):   # the result re-wrapped for autograd: still the same collective's
            self.in_flight = [(id(out), part) if key == id(args[0]) else (key, part) for key, part in self.in_flight]
            return out
        part = self.kinds.part(_group_ranks(func, args), op_name)
        self._end(part, began)
        if func.namespace == "_c10d_functional":
            for tensor in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.in_flight = [*self.in_flight[-IN_FLIGHT_KEPT + 1:], (id(tensor), part)]
        else:
            self._track_work(out, part, start)
        return out

    def _waited(self, tensor: torch.Tensor) -> str:
        """The part of the functional collective whose result `tensor` is; a result its wrapper re-made (a
        reshuffle after a gather) is charged to the latest collective launched, as DTensor waits on a
        redistribution before it launches the next."""
        entry = next((entry for entry in self.in_flight if entry[0] == id(tensor)), None)
        if entry is None:
            return self.in_flight[-1][1] if self.in_flight else "other_comm_s"
        self.in_flight.remove(entry)
        return entry[1]

    def _wait_inputs(self, args) -> None:
        """An `AsyncCollectiveTensor` input is waited on inside this operator's dispatch, where the mode does not
        see it: wait here, timed, first."""
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        for arg in args:
            if isinstance(arg, AsyncCollectiveTensor) and not arg.completed:
                began = self._begin()
                arg.trigger_wait()
                self._end(self._waited(arg.elem), began)

    def _track_work(self, out, part: str, launched: float) -> None:
        work = out[-1] if isinstance(out, tuple) else out
        if not isinstance(work, torch.ScriptObject):
            return
        work = dist.Work.unbox(work)   # the same Python object the caller gets while this one lives
        self.works[id(work)] = (part, work)
        self.launched[id(work)] = launched
        if self.on_stream:   # a future completes when the work is enqueued there, not when it is done
            return
        try:   # gloo's reduce_scatter_single has no future: it is waited from Python, so none is needed
            future = work.get_future()
        except RuntimeError:
            return
        future.then(lambda _, key=id(work): self.completed.__setitem__(key, time.perf_counter()))
