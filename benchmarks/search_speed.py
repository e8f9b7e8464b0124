"""Search time (capture included) and CPU seconds for the cases issues 4 and 16 name; every search must
end complete (status complete: nothing unexplored, every leaf proven) well inside its limit on one core. Where
the plan lies outside the measured region, the time includes the second search inside it.

    .venv/bin/python benchmarks/search_speed.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.api import plan  # noqa: E402
from planner.graph_capture.model_capture import _capture_cached  # noqa: E402

# (model, device, devices, global batch, stack, job extras): Megatron-Core's defaults, torchtitan, whose space adds
# DualPipeV, and Megatron-Bridge's GB200 Llama 3 70B FP8 job, whose pp = 1 leaves weigh activation offloading
CASES = [
    ("llama3-8b", "h100-sxm", 64, 512, "megatron-core", {}),
    ("llama3-70b", "h100-sxm", 1024, 1024, "megatron-core", {}),
    ("gpt3-175b", "a100-80g", 1024, 1536, "megatron-core", {}),
    ("llama3-405b", "h100-sxm", 16384, 2048, "megatron-core", {}),
    ("deepseek-v3", "h800", 2048, 4096, "megatron-core", {}),
    ("kimi-k2", "h800", 8192, 8192, "megatron-core", {}),
    ("deepseek-v3", "h100-sxm", 1024, 4096, "torchtitan", {}),
    ("llama3-70b", "gb200", 64, 256, "megatron-bridge", {"seq_len": 8192, "precision": "fp8"}),
]


def main() -> None:
    print("| model | devices | global batch | stack | wall s | CPU s | candidates | solved | status | best layout "
          "| step s | MFU | best inside the measured region |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, device, devices, batch, stack, extras in CASES:
        _capture_cached.cache_clear()
        start, cpu = time.perf_counter(), time.process_time()
        result = plan(model, device=device, num_devices=devices, global_batch=batch, time_limit_s=60, stack=stack,
                      **extras)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        lay, s = result.layout, result.search
        print(f"| {model} | {devices} x {device} | {batch} | {stack} | {wall:.1f} | {cpu:.1f} | {s.candidates} | "
              f"{s.solved} | {s.status} | tp{lay.tp} pp{lay.pp}x{lay.vp} {lay.schedule} dp{lay.dp} cp{lay.cp} "
              f"ep{lay.ep} mbs{lay.mbs} z{lay.zero}{f' offload{lay.offload_layers}' if lay.offload_layers else ''} | "
              f"{result.step_time_s:.2f} | {result.mfu:.1%} | "
              f"{_inside(result)} |")


def _inside(result) -> str:
    """The best plan inside the measured region where the plan lies outside it (planner/region.py)."""
    if not result.outside_measured:
        return "(the plan is inside)"
    inside = result.inside_measured
    if inside is None:
        return "none found"
    degrees = dict(item.split("=") for item in inside.layout.split(","))
    return (f"tp{degrees['tp']} pp{degrees['pp']}x{degrees.get('vp', 1)} dp{degrees['dp']} cp{degrees['cp']} "
            f"ep{degrees['ep']}: {inside.step_time_s:.2f} s ({inside.step_time_s / result.step_time_s - 1:+.1%})")


if __name__ == "__main__":
    main()
