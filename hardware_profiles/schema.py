"""Typed schemas of device and cluster profiles.

Units live in field names: `_tflops` (10^12 FLOP/s, dense), `_bytes`, `_gbytes_per_s` (10^9 B/s),
`_gbit_per_s` (10^9 bit/s, how NICs are sold), `_us` (microseconds), `_fraction` (0..1].
Every model forbids unknown fields so that a typo is an error, never a silent default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

Precision = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]


# Every number a profile states is 0 or lies within these magnitudes: beyond them it is a unit mistake (bytes
# written as GB, a fraction as a percentage inverted), and the times it gives leave what the solver's 64-bit
# integers hold (1e-300 TFLOP/s is a step of 1e290 s; planner/search/partition_model.py counts in microseconds).
SMALLEST_MAGNITUDE, LARGEST_MAGNITUDE = 1e-6, 1e15
# a kernel's floor, a host call or a hop's latency past a second is no device's: a unit mistake (ms or ns written as
# us); a floor of 3.8e10 us made every layout's terms pass the solver's horizon, and the search found none
MAX_LATENCY_US = 1e6


class Strict(BaseModel):
    # strict: a number written as text or as true/false is an error, never coerced; no nan or inf
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _plausible_magnitude(cls, value):
        numbers = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else (value,)
        for number in numbers:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and number != 0 \
                    and not SMALLEST_MAGNITUDE <= abs(number) <= LARGEST_MAGNITUDE:
                raise ValueError(f"{number!r} is outside the magnitudes a profile holds (0 or "
                                 f"{SMALLEST_MAGNITUDE:g} to {LARGEST_MAGNITUDE:g} in the field's unit)")
        return value


class FabricKind(str, Enum):
    nvswitch = "nvswitch"       # NVIDIA NVLink through NVSwitch: every pair at full per-device bandwidth
    full_mesh = "full-mesh"     # Ascend HCCS: a direct link to every peer, bandwidth split over peers
    xgmi_mesh = "xgmi-mesh"     # AMD/Hygon Infinity Fabric (xGMI) point-to-point mesh
    ub_clos = "ub-clos"         # Huawei CloudMatrix unified bus: switched, all-to-all across the supernode


class PeakTflops(Strict):
    """Dense (no 2:4 sparsity) peak per data type; None where the device lacks it."""
    fp32: float = Field(gt=0)
    tf32: float | None = Field(default=None, gt=0)
    bf16: float = Field(gt=0)
    fp16: float = Field(gt=0)
    fp8: float | None = Field(default=None, gt=0)


class GemmEfficiency(Strict):
    """Achievable GEMM throughput: peak_fraction * work / (work + half_work_flops), in FP8 with the FP8
    fraction and scale where the profile gives them.

    The saturating curve makes small GEMMs (small micro-batch, high TP) less efficient; the
    fraction at large sizes is the measured maximum achievable matmul FLOPS (MAMF).
    """
    peak_fraction: float = Field(gt=0, le=1)
    fp8_peak_fraction: float | None = Field(default=None, gt=0, le=1)
    half_work_gflop: float = Field(ge=0)
    # FP8 GEMMs' own scale (they saturate later: docs/gpu-validation.md; measured on Hopper, fitted on
    # Blackwell by benchmarks/calibrate.py); None: FP8 GEMMs take the one above
    fp8_half_work_gflop: float | None = Field(default=None, ge=0)
    # MXFP8 block-scaled GEMMs' fraction where it is not the per-tensor FP8 one (the scales' loads in the
    # kernel); None: the FP8 fraction
    mxfp8_peak_fraction: float | None = Field(default=None, gt=0, le=1)
    kernel_floor_us: float = Field(ge=0, le=MAX_LATENCY_US)
    # share of MAMF sustained inside a training step (fusions, launch gaps, non-ideal shapes); fitted on
    # published runs by benchmarks/calibrate.py, 1.0 where no run exists
    sustained_fraction: float = Field(default=1.0, gt=0, le=1)


class IntraNodeFabric(Strict):
    kind: FabricKind = Field(strict=False)   # written as its text value in YAML
    bandwidth_per_direction_gbytes_per_s: float = Field(gt=0)
    ring_busbw_fraction: float = Field(gt=0, le=1)
    in_network_reduction: bool = False
    in_network_fraction: float | None = Field(default=None, gt=0, le=1)
    in_network_min_ranks: int = Field(default=2, ge=2)
    base_latency_us: float = Field(ge=0, le=MAX_LATENCY_US)
    hop_latency_us: float = Field(ge=0, le=MAX_LATENCY_US)
    all_to_all_fraction: float = Field(gt=0, le=1)
    # measured by group size where a source gives a curve (DeepEP-style tables): ranks -> fraction,
    # interpolated in log2(ranks) between entries and held at the ends; all_to_all_fraction elsewhere
    all_to_all_fraction_by_ranks: dict[int, float] | None = None

    @model_validator(mode="after")
    def _all_to_all_curve_in_range(self):
        for ranks, fraction in (self.all_to_all_fraction_by_ranks or {}).items():
            if ranks < 2 or not 0 < fraction <= 1:
                raise ValueError(f"all_to_all_fraction_by_ranks: {ranks}: {fraction} is not a group of at least "
                                 "2 ranks with a fraction in (0, 1]")
        return self

    def all_to_all_fraction_for(self, ranks: int) -> float:
        """The all-to-all's share of the link bandwidth for a group of `ranks`."""
        curve = sorted((self.all_to_all_fraction_by_ranks or {}).items())
        if not curve:
            return self.all_to_all_fraction
        if ranks <= curve[0][0]:
            return curve[0][1]
        for (low, low_f), (high, high_f) in zip(curve, curve[1:]):
            if ranks <= high:
                t = (math.log2(ranks) - math.log2(low)) / (math.log2(high) - math.log2(low))
                return low_f + t * (high_f - low_f)
        return curve[-1][1]

    @model_validator(mode="after")
    def _in_network_needs_fraction(self):
        if self.in_network_reduction and self.in_network_fraction is None:
            raise ValueError("in_network_reduction is true but in_network_fraction is missing")
        return self


class MemoryReserve(Strict):
    """HBM the training process cannot use for tensors."""
    runtime_context_bytes: int = Field(ge=0)
    fragmentation_fraction: float = Field(ge=0, lt=1)


class NcclP2pSms(Strict):
    """SMs NCCL's point-to-point kernel (the all-to-all's) holds while it runs: one CTA, one SM, per p2p
    channel, pow2Up(min(channels, 64)) (NVIDIA/nccl src/graph/paths.cc ncclTopoComputeP2pChannels)."""
    within_node: int = Field(gt=0)      # every peer on this node (NVLink)
    across_nodes: int = Field(gt=0)     # peers on other nodes: NCCL picks channels by its NICs then


class Device(Strict):
    name: str
    display_name: str
    vendor: Literal["nvidia", "amd", "huawei", "hygon", "cpu"]
    peak_tflops: PeakTflops
    hbm_bytes: int = Field(gt=0)
    hbm_bandwidth_gbytes_per_s: float = Field(gt=0)
    hbm_bandwidth_fraction: float = Field(gt=0, le=1)
    # device <-> host memory, per direction per device (PCIe or chip-to-chip link): what swapping optimizer
    # states to host costs; None where no profile source gives it (a stack that swaps is then refused)
    host_link_gbytes_per_s: float | None = Field(default=None, gt=0)
    # host memory per device (the node's, shared by its devices): what offloaded activations may fill
    # (Layout.offload_layers); None where no profile source gives it (offloading is then refused)
    host_memory_bytes: int | None = Field(default=None, gt=0)
    # streaming multiprocessors (NVIDIA): what a communication kernel that occupies SMs (DeepEP) takes from
    # the GEMMs running beside it; None where no profile source gives the count
    sm_count: int | None = Field(default=None, gt=0)
    # the DeepEP-style dispatch kernels that run here (the `deepep` MoE dispatcher: Megatron-Core's flex dispatcher
    # with this backend), as Megatron-Bridge's validate_flex_dispatcher_backend allows them: DeepEP on compute
    # capability 8.x and 9.x and on B200/B300, HybridEP on 8.x-10.x (GB200/GB300 NVL72 included); None: neither
    flex_dispatcher_backend: Literal["deepep", "hybridep"] | None = None
    # the share of full speed at which those dispatch kernels progress while compute runs beside them (combined
    # 1F1B's two streams): what an Nsight comparison of the same run with and without the overlap measured; None
    # where none was measured on this device (they are then billed at full speed, and the plan says so)
    flex_dispatch_rate_beside_compute: float | None = Field(default=None, gt=0, le=1)
    # TP communication overlap (TE userbuffers) needs one CUDA connection per device here, and combined 1F1B
    # several (Hopper and earlier): a job runs one or the other (Megatron-LM docs moe_a2a_overlap.md; Megatron-
    # Bridge's H100 Qwen3-235B recipes turn TP overlap off beside it, with CUDA_DEVICE_MAX_CONNECTIONS 8)
    tp_overlap_single_connection: bool = False
    # combined 1F1B pays here only beside whole layers replayed as CUDA graphs: its stages' synchronisation adds
    # more CPU overhead than the all-to-alls it hides over the scale-up domain save (`a2a_overlap_left_off`)
    a2a_overlap_needs_graphs: bool = False
    # what NCCL's all-to-all holds of them (the compute it hides behind runs on the rest); None where no
    # NCCL log for the node is known
    nccl_p2p_sms: NcclP2pSms | None = None
    # CPU time of one torch.nn.Linear forward call issued from Python on the node's host CPU: the unit in which
    # a stack states its host time per call (`SoftwareStack.host_calls`, cost_models/host_time.py); None where
    # no source measured the node's CPU (host time is then not billed, and a plan says so)
    host_call_us: float | None = Field(default=None, gt=0, le=MAX_LATENCY_US)
    # tensor cores that apply MXFP8's per-block scales (Blackwell); the mxfp8 recipe needs them
    mxfp8: bool = False
    # per-tensor FP8 GEMMs take any operand layout (Blackwell: Transformer Engine's is_non_tn_fp8_gemm_supported),
    # so a cast writes no transposed copy for the backward's GEMMs; Hopper's take TN only
    fp8_any_layout: bool = False
    gemm: GemmEfficiency
    intra_node: IntraNodeFabric
    collective_backend: Literal["nccl", "hccl", "rccl", "gloo"]
    torch_device_type: Literal["cuda", "npu", "cpu"]
    memory_reserve: MemoryReserve
    # where the profile was loaded from, so that a plan can name it to another process: a built-in name,
    # an absolute path, or "" for one built in memory (set by the loader, never read from YAML)
    _profile: str = PrivateAttr(default="")

    @property
    def profile(self) -> str:
        return self._profile

    def peak_flops(self, precision: Precision) -> float:
        """Dense peak in FLOP/s for a precision; raises if the device lacks it."""
        value = getattr(self.peak_tflops, precision)
        if value is None:
            raise ValueError(f"device {self.name} has no {precision} peak")
        return value * 1e12


class InterNodeNetwork(Strict):
    kind: Literal["infiniband", "roce", "ethernet", "efa", "none"]
    nic_bandwidth_gbit_per_s: float = Field(gt=0)
    nics_per_node: int = Field(gt=0)
    busbw_fraction: float = Field(gt=0, le=1)
    # NCCL's pairwise all-to-all across nodes: each GPU sends to every remote peer at once through its own NIC
    # (it cannot aggregate a node's NICs, NVIDIA/nccl-tests issue 267), short of the rings' `busbw_fraction`;
    # None where no figure is known: the rings' fraction is assumed and the plan says so
    all_to_all_fraction: float | None = Field(default=None, gt=0, le=1)
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US)
    pod_size_devices: int | None = Field(default=None, gt=0)
    oversubscription_above_pod: float = Field(default=1.0, ge=1)
    in_network_reduction: bool = False


class Storage(Strict):
    checkpoint_write_gbytes_per_s: float = Field(gt=0)
    checkpoint_read_gbytes_per_s: float = Field(gt=0)
    per_writer_gbytes_per_s: float = Field(gt=0)
    async_blocking_fraction: float = Field(ge=0, le=1)


class Reliability(Strict):
    node_failures_per_1000_node_days: float = Field(ge=0)
    restart_s: float = Field(ge=0)
    rewarm_s: float = Field(ge=0)
    hang_fraction: float = Field(ge=0, le=1)      # of interruptions: no process dies, seen at the collective timeout
    sdc_fraction: float = Field(ge=0, le=1)       # of interruptions: silent data corruption, seen at a replica check
    crash_detection_s: float = Field(ge=0)        # a dead process to every rank of the attempt stopped
    node_repair_s: float = Field(ge=0)            # a failed node back in service (waited for when no spare is kept)
    source: str

    @model_validator(mode="after")
    def _fractions_add_up(self):
        if self.hang_fraction + self.sdc_fraction > 1:
            raise ValueError(f"hang_fraction + sdc_fraction = {self.hang_fraction + self.sdc_fraction:g} > 1: "
                             "both are shares of the same interruptions")
        return self


class Cluster(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")   # goes into plans and launch commands
    description: str = ""
    device: Device
    devices_per_node: int = Field(gt=0)
    num_nodes: int = Field(gt=0)
    fast_domain_devices: int = Field(gt=0)
    # the devices the job takes in each scale-up domain when it spans several, in equal segments (Slurm
    # `--segment` nodes x devices per node; Megatron-Bridge's launcher asks for the largest node count of at
    # most 18 that divides the job on GB200); None: the job fills the domains in rank order
    segment_devices: int | None = Field(default=None, gt=0)
    inter_node: InterNodeNetwork
    storage: Storage
    reliability: Reliability
    _profile: str = PrivateAttr(default="")   # as Device._profile; "" for a cluster made from --device

    @property
    def profile(self) -> str:
        return self._profile

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @model_validator(mode="after")
    def _domains_divide(self):
        if self.fast_domain_devices % self.devices_per_node and self.devices_per_node % self.fast_domain_devices:
            raise ValueError(
                f"fast_domain_devices={self.fast_domain_devices} and devices_per_node="
                f"{self.devices_per_node} must divide one another")
        return self

    @model_validator(mode="after")
    def _segments_tile_the_job(self):
        problem = self.segment_problem(self.num_devices)
        if problem:
            raise ValueError(problem)
        return self

    def segment_problem(self, num_devices: int) -> str:
        """Why segment_devices cannot lay out `num_devices` ("" where it can, or where no segment is set)."""
        segment = self.segment_devices
        if segment is None or segment == self.fast_domain_devices:   # the whole domain: packing, stated
            return ""
        if segment > self.fast_domain_devices or segment % self.devices_per_node:
            return (f"segment_devices={segment} is not whole nodes of {self.devices_per_node} inside one "
                    f"{self.fast_domain_devices}-device scale-up domain")
        if num_devices > segment and num_devices % segment:
            return f"segment_devices={segment} does not divide the job's {num_devices} devices into equal segments"
        return ""

    @property
    def equal_segment_devices(self) -> int | None:
        """The equal segment the job is placed in (Slurm --segment); None where it is packed, stated as a whole
        domain's count or not stated."""
        return None if self.segment_devices in (None, self.fast_domain_devices) else self.segment_devices

    @property
    def domain_use(self) -> "DomainUse":
        """How the job's devices fill the scale-up domains: in equal segments where set, else ranks go to
        domains in order, domain by domain."""
        segment = self.equal_segment_devices
        if segment is not None and self.num_devices > segment:   # a job within one segment is one domain's
            return DomainUse(self.fast_domain_devices, self.num_devices // segment, 0, segment)
        full, partial = divmod(self.num_devices, self.fast_domain_devices)
        return DomainUse(self.fast_domain_devices, full, partial)

    @property
    def placement_domain_devices(self) -> int:
        """Consecutive ranks that always share one scale-up domain, the block the mesh placement works in:
        the whole job where it fits one domain (a smaller job still sits inside its NVLink rack or
        supernode); else the largest block that tiles the full domains and a partly used last one (gcd)."""
        use = self.domain_use
        if use.used_per_domain != use.domain_devices:   # equal segments: each is one block
            return use.used_per_domain
        if use.full_domains == 0:
            return self.num_devices
        return math.gcd(self.num_devices, self.fast_domain_devices)

    def placement_text(self) -> str:
        """One line for plans and reports: how many domains, how full, and the block collectives assume."""
        use, fabric = self.domain_use, self.device.intra_node.kind.value
        domain = f"{use.domain_devices}-device {fabric} domain"
        if use.full_domains == 0:
            return f"{self.num_devices} of one {domain}"
        if use.used_per_domain != use.domain_devices:
            return f"{use.used_per_domain} devices in each of {use.full_domains} {domain}s (equal segments)"
        text = f"{use.full_domains} full {domain}{'s' if use.full_domains > 1 else ''}"
        if use.partial_devices:
            text += (f" and {use.partial_devices} devices of another; collectives are costed in blocks of "
                     f"{self.placement_domain_devices} ranks, the largest that never straddles a domain")
        return text

    def with_devices(self, num_devices: int) -> "Cluster":
        """The same cluster with another device count (what-if sweeps); a job smaller than a node sits inside
        one node, using that many of its devices."""
        if 0 < num_devices < self.devices_per_node and self.segment_devices is None:
            node_is_domain = self.fast_domain_devices == self.devices_per_node
            return self.model_copy(update={"num_nodes": 1, "devices_per_node": num_devices,
                                           "fast_domain_devices": num_devices if node_is_domain
                                           else self.fast_domain_devices})
        if num_devices <= 0 or num_devices % self.devices_per_node:
            raise ValueError(f"{num_devices} devices do not fill whole nodes of {self.devices_per_node}")
        if self.segment_problem(num_devices):
            raise ValueError(self.segment_problem(num_devices))
        return self.model_copy(update={"num_nodes": num_devices // self.devices_per_node})


@dataclass(frozen=True)
class DomainUse:
    """The job's devices over scale-up (NVLink, HCCS, UB) domains."""
    domain_devices: int       # one physical domain
    full_domains: int         # domains the job fills (with equal segments: the domains it uses)
    partial_devices: int      # devices in a last, partly used domain (0: none)
    segment_devices: int | None = None   # devices used in each domain with equal segments

    @property
    def used_per_domain(self) -> int:
        return self.segment_devices or self.domain_devices

    @property
    def crosses_domains(self) -> bool:
        return self.full_domains + (1 if self.partial_devices else 0) > 1
