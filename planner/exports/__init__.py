"""Plans in the formats of the frameworks users already run: Megatron-LM, Megatron-Bridge, torchtitan,
DeepSpeed, and launcher lines (torchrun, sbatch) for this project's runtime. Each export is text and notes:
per setting the target cannot express, what the framework will do instead."""
from __future__ import annotations

from dataclasses import dataclass

from hardware_profiles.errors import UserInputError

from ..plans import Plan
from ..rules.device import check_plan_device
from .bridge import bridge_overrides, bridge_yaml
from .deepspeed import deepspeed_json
from .launch import sbatch_script, torchrun_command
from .megatron import megatron_args, megatron_pipeline_layout
from .torchtitan import torchtitan_args, torchtitan_command

__all__ = ["CHECKED_RELEASES", "RELEASE_OF", "Export", "export", "export_target", "bridge_overrides", "bridge_yaml",
           "deepspeed_json", "megatron_args",
           "megatron_pipeline_layout", "sbatch_script", "torchrun_command", "torchtitan_args", "torchtitan_command"]

# the release of each tool whose own code reads the export back in the tests (constraints.txt pins them)
CHECKED_RELEASES = {"megatron": "0.16", "megatron-bridge": "0.3", "torchtitan": "0.3", "deepspeed": "0.18",
                    "torchrun": "2.13", "sbatch": "2.13"}
RELEASE_OF = {"megatron": "megatron-core", "megatron-bridge": "megatron-bridge", "torchtitan": "torchtitan",
              "deepspeed": "deepspeed", "torchrun": "torch", "sbatch": "torch"}


@dataclass(frozen=True)
class Export:
    target: str
    release: str
    text: str
    notes: tuple[str, ...]


def export_target(text: str) -> tuple[str, str]:
    """`NAME` or `NAME@RELEASE` -> (name, release); a release other than the checked one is refused."""
    name, at, release = text.partition("@")
    if name not in CHECKED_RELEASES:
        raise UserInputError(f"'{text}'", field="--to", expected=f"{', '.join(CHECKED_RELEASES)}, optionally "
                             "@RELEASE")
    checked = CHECKED_RELEASES[name]
    # a release names at least major.minor (`megatron@0` is every 0.x): the checked one, or a patch of it
    precise = release.count(".") >= 1 and (checked == release or checked.startswith(release + ".")
                                            or release.startswith(checked + "."))
    if at and not precise:
        raise UserInputError(f"'{text}'", field="--to", expected=f"{name}@{checked}: the {RELEASE_OF[name]} release "
                             "this export is written for and checked against (no other release is)")
    return name, checked


def export(plan: Plan, to: str, plan_path: str) -> Export:
    """The plan for target `to` (`export_target`'s form), as text with its notes."""
    target, release = export_target(to)
    check_plan_device(plan)
    if target == "megatron":
        args, notes = megatron_args(plan)
        text = " \\\n  ".join(args)
    elif target == "megatron-bridge":
        text, notes = bridge_yaml(plan)
    elif target == "torchtitan":
        text, notes = torchtitan_command(plan)
    elif target == "deepspeed":
        text, notes = deepspeed_json(plan)
    elif target == "sbatch":
        text, notes = sbatch_script(plan, plan_path)
    else:
        text, notes = torchrun_command(plan, plan_path)
    return Export(RELEASE_OF[target], release, text.rstrip("\n"), tuple(notes))
