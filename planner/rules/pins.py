"""`Pins`: the layout fields a user fixed (`--fix tp=8,pp=16`, `planner.plan(..., tp=8)`, a partial `--layout`),
and the space the software stack leaves the search.

The pinnable fields are derived from the declarations on `Layout` (`LayoutField.pin`), keyed as users write
them; a field left `None` is the search's to choose, or takes the stack's default.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, make_dataclass

from cost_models.layout import Layout
from cost_models.layout_codec import FIELDS, FULL_KEYS, values_of


@dataclass(frozen=True)
class DualPipeVRules:
    """Where the software stack runs DualPipeV (`SoftwareStack.dualpipev_*`)."""
    even_split: bool = False     # layers a multiple of 2 pp, split evenly
    beside_cp: bool = True       # with context parallelism

    def problems(self, pp: int | None, cp: int | None, num_blocks: int | None, stack_name: str) -> list[str]:
        """What of these degrees the stack's DualPipeV cannot run (a degree or layer count not known: no rule)."""
        problems = []
        if cp and cp > 1 and not self.beside_cp:
            problems.append(f"schedule=dualpipev with cp={cp}: the {stack_name} stack runs DualPipeV without "
                            "context parallelism")
        if self.even_split and pp and num_blocks is not None and num_blocks % (2 * pp):
            problems.append(f"schedule=dualpipev with pp={pp}: the {stack_name} stack splits the layers evenly "
                            f"over 2 pp = {2 * pp} chunks, and the model has {num_blocks}")
        return problems


def splits_evenly(even_split: bool, num_blocks: int, chunks: int) -> bool:
    """Whether a stack that splits the layers evenly over the pipeline chunks (`even_split`) can cut
    `num_blocks` layers into `chunks`."""
    return not even_split or num_blocks % chunks == 0


@dataclass(frozen=True)
class _StackSpace:
    """What the software stack runs, set by `rules.stack.stack_pins` (the search reads it with the pins), and the
    per-rank shapes a search is kept to (the measured region: planner/region.py)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    dualpipev: DualPipeVRules | None = None       # its DualPipeV, None where it has none
    interleaved_schedule: bool = True             # whether it interleaves virtual stages
    even_pipeline_split: bool = False             # whether it splits the layers evenly over the chunks
    shape_bounds: tuple = ()                      # region.ShapeBound per degree kept inside a range; () none
    measured_dispatchers: tuple = ()              # the MoE dispatchers a search is kept to (the region's); () any
    zero3_ranks_max: int | None = None            # the most dp x cp ranks ZeRO-3 may shard over (the region's); None any

    def allows(self, name: str, value) -> bool:
        """Whether the search may give field `name` (a user key) this value: the pin's, or any the stack runs,
        inside the shape bounds."""
        if name == "zero" and value not in self.zero_stages:
            return False
        if any(bound.degree == name and not bound.allows(value) for bound in self.shape_bounds):
            return False
        pinned = getattr(self, name)
        return pinned is None or pinned == value

    def allows_chunks(self, num_blocks: int, chunks: int) -> bool:
        """Whether the stack can cut the model's layers into `chunks` pipeline chunks (`splits_evenly`)."""
        return splits_evenly(self.even_pipeline_split, num_blocks, chunks)


PIN_KEYS = tuple(key for key, declared in FIELDS.items() if declared.field.pin)
# a pin per pinnable field, keyed as users write them (None: not pinned)
Pins = make_dataclass("Pins", [(key, object, None) for key in PIN_KEYS], bases=(_StackSpace,), frozen=True)
Pins.__doc__ = "Layout fields the user fixed (None: free), and what the stack runs (`_StackSpace`)."
Pins.__module__ = __name__
STACK_SPACE = tuple(f.name for f in fields(_StackSpace))


def pins_from(values: dict) -> "Pins":
    """Pins of typed values by key (`layout_codec.parse_text`/`parse_values`); keys that are not pins (the
    job's batch and precision, a whole split) are left out."""
    return Pins(**{key: value for key, value in values.items() if key in PIN_KEYS})


def pins_of(layout: Layout, keys: tuple[str, ...] = FULL_KEYS + ("recompute_modules", "schedule")) -> "Pins":
    """A whole layout as pins: every degree fixed (and `keys` beside them)."""
    return pins_from(values_of(layout, keys))
