"""One layout vocabulary: the keys users write and the `Layout` fields they mean, parsed and printed once.

The same keys are the layout text (`--layout`, `--fix`, `examples/train_tiny.py --layout`), the keyword
arguments of the API (`planner.plan(..., tp=8, recompute="full")`), the fields of a plan file's `layout`
record and the strings the plan prints for its alternatives. Every conversion between them goes
through this module, so a key means the same thing everywhere.
"""
from __future__ import annotations

from hardware_profiles.errors import UserInputError

from .layout import (DEFAULT_RECOMPUTE_MODULES, MEGATRON_ORDER, Fp8Recipe, GradReduce, Layout, Precision, Recompute,
                     RecomputeModule, Schedule, TextEnum)

# key as users write it -> the Layout attribute it sets
ATTRIBUTES = {"dp": "dp", "tp": "tp", "pp": "pp", "vp": "vp", "cp": "cp", "ep": "ep", "etp": "etp",
              "mbs": "micro_batch", "gbs": "global_batch", "zero": "zero", "recompute": "recompute",
              "sp": "sequence_parallel", "a2a_overlap": "moe_a2a_overlap", "precision": "precision",
              "grad_reduce": "grad_reduce", "fp8_recipe": "fp8_recipe", "order": "mesh_order",
              "stages": "stage_layers", "recompute_modules": "recompute_modules", "schedule": "schedule",
              "recompute_layers": "recompute_layers"}
LAYOUT_KEYS = tuple(ATTRIBUTES)
CHOICES: dict[str, type[TextEnum]] = {"recompute": Recompute, "precision": Precision, "grad_reduce": GradReduce,
                                      "fp8_recipe": Fp8Recipe, "schedule": Schedule}
WHAT = {"recompute": "none, selective or full", "precision": "bf16 or fp8", "grad_reduce": "fp32 or bf16",
        "fp8_recipe": "delayed, tensorwise, mxfp8 or blockwise (Megatron --fp8-recipe)",
        "schedule": "1f1b (vp=1), interleaved-1f1b (vp > 1) or dualpipev (vp=2, two chunks per rank as a V)"}
SWITCHES = ("sp", "a2a_overlap")   # true or false
FULL_KEYS = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "zero", "recompute")   # a whole layout's degrees
MAX_CHUNKS = 1 << 14
MODULES_WHAT = f"modules joined by '+', each one of {', '.join(RecomputeModule.texts())} (Megatron --recompute-modules)"


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
        values[key] = _parse_value(key, raw, source)
    return values


def parse_values(given: dict, source: str = "layout") -> dict:
    """Typed values from the API (`plan(..., tp=8, recompute="full")`, `evaluate(layout={...})`), checked as
    strictly as the text form: an integer field takes an int (not a bool, float or text), a choice its
    name or enum, `sp` a bool, `order` a sequence of dims or 'tp-cp-ep-dp-pp'."""
    values = {}
    for key, value in given.items():
        _check_key(key, source)
        if key in CHOICES:
            if not isinstance(value, str):
                raise UserInputError(f"{key}={value!r}", field=source, expected=WHAT[key])
            values[key] = _parse_value(key, str(value), source)
        elif key in SWITCHES:
            if not isinstance(value, bool):
                raise UserInputError(f"{key}={value!r}", field=source, expected=f"{key}=True or {key}=False")
            values[key] = value
        elif key == "stages":
            if isinstance(value, (tuple, list)):
                value = "-".join(str(c) if isinstance(c, int) and not isinstance(c, bool) else "x" for c in value)
            if not isinstance(value, str):
                raise UserInputError(f"stages={value!r}", field=source, expected="layer counts per chunk")
            values[key] = _parse_value(key, value, source)
        elif key == "recompute_modules":
            names = value.split("+") if isinstance(value, str) else value
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
                raise UserInputError(f"recompute_modules={value!r}", field=source, expected=MODULES_WHAT)
            values[key] = _parse_value(key, "+".join(names), source)
        elif key == "order":
            dims = value.split("-") if isinstance(value, str) else value
            if not isinstance(dims, (tuple, list)) or not all(isinstance(d, str) for d in dims):
                raise UserInputError(f"order={value!r}", field=source, expected="a sequence of mesh dims")
            values[key] = _parse_value(key, "-".join(dims), source)
        else:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserInputError(f"{key}={value!r} is not an integer", field=source,
                                     expected=f"{key}=<positive integer>")
            values[key] = _parse_value(key, str(value), source)
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
        raise UserInputError(f"schedule={schedule} with vp={vp}", field="schedule", expected=WHAT["schedule"])
    return Layout(**{ATTRIBUTES[key]: value for key, value in values.items()}, **fixed,
                  **({"dualpipev": True} if schedule == Schedule.dualpipev else {}))


def values_of(layout: Layout, keys: tuple[str, ...] = LAYOUT_KEYS) -> dict:
    """The layout's values by key."""
    return {key: getattr(layout, ATTRIBUTES[key]) for key in keys}


def text_of(layout: Layout) -> str:
    """The layout as `--layout` text: every degree, and the other keys where they are not the default."""
    parts = [f"{key}={value}" for key, value in values_of(layout, FULL_KEYS).items()]
    if layout.mesh_order != MEGATRON_ORDER:
        parts.append("order=" + "-".join(layout.mesh_order))
    if layout.dualpipev:
        parts.append(f"schedule={Schedule.dualpipev}")
    if layout.moe_a2a_overlap:
        parts.append("a2a_overlap=true")
    if layout.grad_reduce != GradReduce.fp32:
        parts.append(f"grad_reduce={layout.grad_reduce}")
    if layout.precision == Precision.fp8 and layout.fp8_recipe != Fp8Recipe.delayed:
        parts.append(f"fp8_recipe={layout.fp8_recipe}")
    if layout.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
        parts.append(f"recompute_modules={modules_text(layout.recompute_modules)}")
    if layout.recompute_layers is not None:
        parts.append(f"recompute_layers={layout.recompute_layers}")
    return ",".join(parts)


def modules_text(modules: tuple[RecomputeModule, ...]) -> str:
    return "+".join(map(str, modules))


def _parse_modules(raw: str, source: str) -> tuple[RecomputeModule, ...]:
    """'mla_up_proj+mlp' -> the modules in RecomputeModule order, each once."""
    names = [n.strip() for n in raw.split("+")]
    if not all(n in RecomputeModule.texts() for n in names) or len(set(names)) != len(names):
        raise UserInputError(f"recompute_modules={raw}", field=source, expected=MODULES_WHAT + ", each once")
    return tuple(m for m in RecomputeModule if m.value in names)


def _parse_stages(raw: str, source: str) -> tuple[int, ...]:
    """'0-2*7-1' -> decoder layers per chunk, in chunk order (chunk c * pp + i runs on pipeline rank i):
    counts joined by '-', a count followed by '*n' repeated n times."""
    counts = []
    for part in raw.split("-"):
        count, _, repeat = part.partition("*")
        if not count.isdigit() or (repeat and not repeat.isdigit()) or len(part) > 12:
            raise UserInputError(f"stages={raw}", field=source,
                                 expected="layer counts per chunk joined by '-', e.g. stages=0-2*7-1")
        counts += [int(count)] * (int(repeat) if repeat else 1)
        if len(counts) > MAX_CHUNKS:
            raise UserInputError(f"stages= lists more than {MAX_CHUNKS} chunks", field=source,
                                 expected=f"at most {MAX_CHUNKS} chunks")
    return tuple(counts)


def _check_key(key: str, source: str) -> None:
    if key not in ATTRIBUTES:
        raise UserInputError(f"unknown key '{key}'", field=source, expected=f"one of {', '.join(LAYOUT_KEYS)}")


def _parse_value(key: str, raw: str, source: str):
    if key in CHOICES:
        try:
            return CHOICES[key](raw)
        except ValueError:
            raise UserInputError(f"{key}={raw}", field=source, expected=WHAT[key]) from None
    if key == "order":
        order = tuple(raw.split("-"))
        if sorted(order) != sorted(MEGATRON_ORDER):
            raise UserInputError(f"order={raw}", field=source,
                                 expected="the five mesh dims innermost first, each once, e.g. tp-cp-ep-dp-pp")
        return order
    if key == "stages":
        return _parse_stages(raw, source)
    if key == "recompute_modules":
        return _parse_modules(raw, source)
    if key in SWITCHES:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise UserInputError(f"{key}={raw}", field=source, expected="true or false")
        return raw.lower() in ("true", "1")
    try:
        value = int(raw)
    except ValueError:
        raise UserInputError(f"{key}={raw} is not an integer", field=source, expected=f"{key}=<positive integer>") from None
    if key == "zero" and value not in (0, 1, 2, 3):
        raise UserInputError(f"zero={value}", field=source, expected="a ZeRO stage 0, 1, 2 or 3")
    if key != "zero" and value <= 0:
        raise UserInputError(f"{key}={value}", field=source, expected=f"{key} >= 1")
    return value
