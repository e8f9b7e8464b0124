"""The region of layouts published runs measured (issue 43: extrapolation is said), written to
planner/measured_region.yaml: per class (dense, MoE), the range of each per-rank shape over every usable row of
shared/validation, read from its published degrees and its model (no prediction involved):

- tokens_per_cp_rank: the sequence over cp (context parallelism's chunk; its per-chunk overheads grow as it shrinks)
- hidden_per_tp_rank: the hidden size over tp (the width of each rank's GEMMs)
- experts_per_ep_rank: routed experts over ep (MoE)
- zero3_ranks_max: the most ranks (dp x cp: devices over tp x pp) any run sharded its parameters over with ZeRO-3 or
  FSDP; 0 where none did (a sharded all-gather of every layer's weights, twice per micro-batch, that the model hides
  under compute at the fabric's full rate, which Narayanan et al. 2021's DeepSpeed ZeRO-3 runs did not reach at 768
  A100s and more: docs/ranking.md)
- dispatchers: by device, the MoE dispatchers the runs' stacks and launchers ran (MoE; benchmarks/published.py
  run_stack)
- a2a_overlap_devices: the devices whose MoE runs ran combined 1F1B (as their stacks and launchers set it)
- a2a_overlap_ab: by device, the published A/Bs of combined 1F1B in benchmarks/sweeps.yaml (never fitted: two
  variants whose layouts differ in `a2a_overlap` alone): the share of the step each measured it saving, and the
  share the model credits it at that layout (predicted now, as benchmarks/ranking.py predicts the sweeps), and
  which profile value its source also gave (`informs`), so that the plan does not count it as independent

A plan outside a range says so (planner/region.py), and a plan running combined 1F1B on a device with an A/B
says what the A/B measured against what the model credited there.

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
from benchmarks.ranking import SWEEPS, published_sweeps, variant_layout  # noqa: E402
from cost_models.layout_codec import parse_text  # noqa: E402
from planner.region import REGION_PATH, shapes  # noqa: E402


def overlap_abs(sweeps_path: Path = SWEEPS) -> dict[str, list[dict]]:
    """Device -> the published A/Bs of combined 1F1B on it: each job, its source, the step share it measured
    combined 1F1B saving and the share the model credits it (1 - on / off, both)."""
    entries = yaml.safe_load(Path(sweeps_path).read_text())
    predicted = {sweep.name: sweep for sweep in published_sweeps(sweeps_path)}
    found: dict[str, list[dict]] = {}
    for entry in entries:
        variants = entry["variants"]
        if len(variants) != 2 or any(set(v) - {"label", "layout", "settings", "measured"} for v in variants):
            continue
        layouts = [parse_text(variant_layout(v)) for v in variants]
        differ = {key for key in layouts[0].keys() | layouts[1].keys() if layouts[0].get(key) != layouts[1].get(key)}
        if differ != {"a2a_overlap"}:
            continue
        by_switch = dict(zip((values["a2a_overlap"] for values in layouts), predicted[entry["name"]].variants))
        off, on = by_switch[False], by_switch[True]
        found.setdefault(entry["device"], []).append({
            "job": entry["name"], "source": " ".join(entry["source"].split()[:2]),
            "measured_saving": round(1 - on.measured_s / off.measured_s, 4),
            "model_saving": round(1 - on.predicted_s / off.predicted_s, 4),
            **({"informs": entry["informs"]} if "informs" in entry else {})})
    return found


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
        sharded = run.cluster.num_devices // (run.known.get("tp", 1) * run.known.get("pp", 1)) \
            if run.sharded_parameters else 0
        region[kind]["zero3_ranks_max"] = max(region[kind].get("zero3_ranks_max", 0), sharded)
        if moe:
            stack, device = run_stack(run.id), run.cluster.device.name
            by_device = region[kind].setdefault("dispatchers", {})
            by_device[device] = sorted(set(by_device.get(device, [])) | {stack.moe_dispatcher})
            overlap = run.known.get("a2a_overlap", stack.moe_a2a_overlap)
            devices = set(region[kind].get("a2a_overlap_devices", [])) | ({device} if overlap else set())
            region[kind]["a2a_overlap_devices"] = sorted(devices)
    region.setdefault("MoE", {})["a2a_overlap_ab"] = overlap_abs()
    header = ("# Written by benchmarks/measured_region.py (do not edit): per class, the range of each per-rank shape\n"
              "# over the published degrees of shared/validation's usable runs; a2a_overlap_ab from the never-fitted\n"
              "# A/Bs of benchmarks/sweeps.yaml.\n")
    REGION_PATH.write_text(header + yaml.safe_dump(region, sort_keys=True))
    print(yaml.safe_dump(region, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
