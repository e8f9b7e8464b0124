"""The region of layouts published runs measured (issue 43: extrapolation is said), written to
planner/measured_region.yaml: per class (dense, MoE), the range of each per-rank shape over every usable row of
shared/validation, read from its published degrees and its model (no prediction involved):

- tokens_per_cp_rank: the sequence over cp (context parallelism's chunk; its per-chunk overheads grow as it shrinks)
- hidden_per_tp_rank: the hidden size over tp (the width of each rank's GEMMs)
- experts_per_ep_rank: routed experts over ep (MoE)
- dispatchers: by device, the MoE dispatchers the runs' stacks and launchers ran (MoE; benchmarks/published.py
  run_stack)
- a2a_overlap_devices: the devices whose MoE runs ran combined 1F1B (as their stacks and launchers set it)

A plan outside a range says so (planner/region.py).

    .venv/bin/python benchmarks/measured_region.py [--runs ../shared/validation/published_runs.yaml]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_sources import NOT_USABLE  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, load_runs, run_stack  # noqa: E402
from planner.region import REGION_PATH, shapes  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    args = parser.parse_args(argv)
    runs, _ = load_runs(args.runs)
    region: dict = {}
    for run in runs:
        if run.id in NOT_USABLE:
            continue
        moe = run.model.moe
        kind = "MoE" if moe else "dense"
        measured = shapes(run.seq_len, run.model.hidden_size, moe.num_experts if moe else 0,
                          run.known.get("tp", 1), run.known.get("cp", 1), run.known.get("ep", 1))
        for name, value in measured.items():
            low, high = region.setdefault(kind, {}).get(name, [value, value])
            region[kind][name] = [min(low, value), max(high, value)]
        region[kind]["runs"] = region[kind].get("runs", 0) + 1
        if moe:
            stack, device = run_stack(run.id), run.cluster.device.name
            by_device = region[kind].setdefault("dispatchers", {})
            by_device[device] = sorted(set(by_device.get(device, [])) | {stack.moe_dispatcher})
            overlap = run.known.get("a2a_overlap", stack.moe_a2a_overlap)
            devices = set(region[kind].get("a2a_overlap_devices", [])) | ({device} if overlap else set())
            region[kind]["a2a_overlap_devices"] = sorted(devices)
    header = ("# Written by benchmarks/measured_region.py (do not edit): per class, the range of each per-rank shape\n"
              "# over the published degrees of shared/validation's usable runs.\n")
    REGION_PATH.write_text(header + yaml.safe_dump(region, sort_keys=True))
    print(yaml.safe_dump(region, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
