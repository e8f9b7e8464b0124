"""One layout vocabulary: the keys users write and the `Layout` fields they mean, parsed and printed once.

The same keys are the layout text (`--layout`, `--fix`, the runtime's `--layout`), the keyword arguments
of the API (`planner.plan(..., tp=8, recompute="full")`), the fields of a plan file's `layout` record and
the strings the plan prints for its alternatives. Every table here is derived from the declarations on
`Layout` (`cost_models/layout.py`); every conversion between the forms goes through this module.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from hardware_profiles.errors import UserInputError

from .layout import (DEFAULT_RECOMPUTE_MODULES, MEGATRON_ORDER, Fp8Recipe, GradReduce, Layout, MoeDispatcher, Precision,
                     Recompute, Schedule, first_blocks_of_each_chunk)
from .layout_domains import MODULES_WHAT, Choice, DomainError, LayoutField, Switch

__all__ = ["FIELDS", "LAYOUT_KEYS", "FULL_KEYS", "ATTRIBUTES", "MODULES_WHAT", "Declared", "parse_text",
           "parse_values", "layout_from", "values_of", "text_of", "modules_text"]


@dataclass(frozen=True)
class Declared:
    """A declared layout field with the `Layout` attribute it sits on."""
    attribute: str
    field: LayoutField

    @property
    def key(self) -> str:
        return self.field.key

    @property
    def reads(self) -> str:
        """The attribute or property that holds the value users write."""
        return self.field.reads or self.attribute


FIELDS: dict[str, Declared] = {item.metadata["layout"].key: Declared(item.name, item.metadata["layout"])
                               for item in fields(Layout) if "layout" in item.metadata}
LAYOUT_KEYS = tuple(FIELDS)
ATTRIBUTES = {key: declared.reads for key, declared in FIELDS.items()}     # key -> what Layout holds it in
FULL_KEYS = tuple(key for key, declared in FIELDS.items() if declared.field.whole)   # a whole layout's degrees
SWITCHES = tuple(key for key, declared in FIELDS.items() if isinstance(declared.field.domain, Switch))
CHOICES = {key: declared.field.domain.kind for key, declared in FIELDS.items()
           if isinstance(declared.field.domain, Choice)}


def _domain_error(exc: DomainError, source: str) -> UserInputError:
    return UserInputError(exc.message, field=source, expected=exc.expected)


def parse_text(text: str, source: str = "--layout") -> dict:
    """'tp=8,pp=16,recompute=selective' -> typed values by key; a clear error for anything else."""
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise UserInputError(f"'{item}' is not key=value", field=source,
                                 expected="comma-separated key=value pairs such as 'tp=8,pp=4'")
        key, raw = (s.strip() for s in item.split("=", 1))
        _check_key(key, source)
        if key in values:
            raise UserInputError(f"'{key}' is given twice", field=source, expected=f"each key once ({key}=...)")
        try:
            values[key] = FIELDS[key].field.domain.from_text(key, raw)
        except DomainError as exc:
            raise _domain_error(exc, source) from None
    return values


def parse_values(given: dict, source: str = "layout") -> dict:
    """Typed values from the API (`plan(..., tp=8, recompute="full")`, `evaluate(layout={...})`), checked as
    strictly as the text form: an integer field takes an int (not a bool, float or text), a choice its
    name or enum, `sp` a bool, `order` a sequence of dims or 'tp-cp-ep-dp-pp'."""
    values = {}
    for key, value in given.items():
        _check_key(key, source)
        try:
            values[key] = FIELDS[key].field.domain.from_value(key, value)
        except DomainError as exc:
            raise _domain_error(exc, source) from None
    return values


def layout_from(values: dict, **fixed) -> Layout:
    """Typed values by key (and `fixed` Layout attributes, e.g. global_batch=...) -> a Layout; keys left
    out take Layout's defaults (Megatron's). `schedule` is read from vp unless it is DualPipeV (vp = 2,
    set where not given); a schedule that vp contradicts is refused."""
    values = dict(values)
    schedule = values.pop("schedule", None)
    if schedule == Schedule.dualpipev:
        values.setdefault("vp", 2)
    vp = values.get("vp", 1)
    implied = Schedule.dualpipev if schedule == Schedule.dualpipev and vp == 2 else \
        Schedule.interleaved if vp > 1 else Schedule.one_f_one_b
    if schedule is not None and schedule != implied:
        raise UserInputError(f"schedule={schedule} with vp={vp}", field="schedule",
                             expected=FIELDS["schedule"].field.domain.what)
    return Layout(**{FIELDS[key].attribute: value for key, value in values.items()}, **fixed,
                  **({"dualpipev": True} if schedule == Schedule.dualpipev else {}))


def values_of(layout: Layout, keys: tuple[str, ...] = LAYOUT_KEYS) -> dict:
    """The layout's values by key."""
    return {key: getattr(layout, ATTRIBUTES[key]) for key in keys}


def text_of(layout: Layout, per_block: bool = True) -> str:
    """The layout as `--layout` text: every degree, and the other keys where they are not the default.
    `per_block`: the recomputation the search chose per block where the layout carries it (`recompute_text`);
    False: the `recompute` field alone (the search's tie-break, which must not change with the chosen list)."""
    values = values_of(layout, FULL_KEYS)
    blocks_text = recompute_text(layout) if per_block else None
    if blocks_text is not None:
        values["recompute"] = blocks_text[0]
    parts = [f"{key}={value}" for key, value in values.items()]
    if layout.mesh_order != MEGATRON_ORDER:
        parts.append("order=" + "-".join(layout.mesh_order))
    if layout.dualpipev:
        parts.append(f"schedule={Schedule.dualpipev}")
    if layout.moe_a2a_overlap:
        parts.append("a2a_overlap=true")
    if layout.tp_comm_overlap:
        parts.append("tp_overlap=true")
    if layout.moe_dispatcher != MoeDispatcher.alltoall:
        parts.append(f"dispatcher={layout.moe_dispatcher}")
    if layout.grad_reduce != GradReduce.fp32:
        parts.append(f"grad_reduce={layout.grad_reduce}")
    if layout.precision == Precision.fp8 and layout.fp8_recipe != Fp8Recipe.delayed:
        parts.append(f"fp8_recipe={layout.fp8_recipe}")
    if layout.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
        parts.append(f"recompute_modules={modules_text(layout.recompute_modules)}")
    layers = blocks_text[1] if blocks_text is not None else layout.recompute_layers
    if layers is not None:
        parts.append(f"recompute_layers={layers}")
    if layout.offload_layers:
        parts.append(f"offload_layers={layout.offload_layers}")
    return ",".join(parts)


def recompute_text(layout: Layout) -> tuple[str, int | None] | None:
    """The per-block recomputation a searched layout carries (`Layout.layer_recompute`, which overrides
    `recompute`) as the layout text's (recompute, recompute_layers): one method for every block, or Megatron's
    block method (the first N blocks of each chunk fully, the rest none); any other mix is 'per-layer', which only
    a plan file's stages can state. None: the layout carries no list."""
    blocks = layout.layer_recompute
    if not blocks:
        return None
    kinds = set(blocks)
    if len(kinds) == 1:
        return str(blocks[0]), None
    if layout.stage_layers and kinds == {Recompute.full, Recompute.none}:
        for count in range(1, max(layout.stage_layers)):
            if first_blocks_of_each_chunk(layout.stage_layers, count) == tuple(blocks):
                return str(Recompute.full), count
    return "per-layer", None


def modules_text(modules) -> str:
    return FIELDS["recompute_modules"].field.domain.text(modules)


def _check_key(key: str, source: str) -> None:
    if key not in FIELDS:
        raise UserInputError(f"unknown key '{key}'", field=source, expected=f"one of {', '.join(LAYOUT_KEYS)}")
