"""What a layout field carries beyond its Python type: its keys, its domain, and who chooses it.

Each `Layout` attribute is declared once, in `cost_models/layout.py`, with a `LayoutField` as its metadata.
Everything else that names layout fields (the layout text and API keywords of `layout_codec`, the search's
pins, the plan file's layout record, replan's difference, the runtime) is derived from those declarations.
A domain turns the text users write into a value and back, checks the API's typed values as strictly, and
says what it expects in the words the errors use.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from hardware_profiles.errors import clip

from .layout_choices import MEGATRON_ORDER, RecomputeModule, TextEnum

MAX_CHUNKS = 1 << 14
MAX_DEGREE = 1 << 20      # a plan file's degrees (a million devices per dimension is a typo)


class DomainError(ValueError):
    """A value outside its domain: what was given and what was expected (the codec names the field)."""

    def __init__(self, message: str, expected: str):
        super().__init__(message)
        self.message, self.expected = message, expected


@dataclass(frozen=True)
class Domain:
    """Text <-> value for one kind of layout value (subclasses below)."""

    def from_text(self, key: str, raw: str) -> Any:
        raise NotImplementedError

    def from_value(self, key: str, value: Any) -> Any:
        """A typed value from the API, held to the text form's rules (an int is not a bool, a float or text)."""
        raise NotImplementedError

    def text(self, value: Any) -> str:
        return str(value)

    def plan_annotation(self) -> Any:
        """The plan file's type for this value (pydantic)."""
        raise NotImplementedError

    def to_plan(self, value: Any) -> Any:
        """The value as a plan file keeps it."""
        return value

    def from_plan(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Count(Domain):
    """A whole number of at least `least` (degrees, batch sizes, layer counts)."""
    least: int = 1
    plan_most: int | None = MAX_DEGREE

    def from_text(self, key: str, raw: str) -> int:
        value = _integer(key, raw)
        if value < self.least:
            raise DomainError(f"{key}={value}", f"{key} >= {self.least}")
        return value

    def from_value(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DomainError(f"{key}={value!r} is not an integer",
                              f"{key}=<positive integer>" if self.least == 1 else f"{key}=<integer >= {self.least}>")
        return self.from_text(key, str(value))

    def plan_annotation(self) -> Any:
        from typing import Annotated
        from pydantic import Field
        return Annotated[int, Field(ge=self.least, le=self.plan_most)] if self.plan_most else \
            Annotated[int, Field(ge=self.least)]


def _integer(key: str, raw: str) -> int:
    """Decimal ASCII digits only: int() would also take '2_0', ' 2' and other scripts' digits."""
    if not re.fullmatch(r"[+-]?[0-9]{1,18}", raw):
        raise DomainError(f"{key}={clip(raw)} is not an integer", f"{key}=<positive integer>")
    return int(raw)


@dataclass(frozen=True)
class ZeroStage(Count):
    """A ZeRO stage: 0 (none), 1 (optimizer states), 2 (and gradients), 3 (and parameters)."""
    least: int = 0

    def from_text(self, key: str, raw: str) -> int:
        value = _integer(key, raw)
        if value not in (0, 1, 2, 3):
            raise DomainError(f"{key}={value}", "a ZeRO stage 0, 1, 2 or 3")
        return value

    def plan_annotation(self) -> Any:
        return Literal[0, 1, 2, 3]


@dataclass(frozen=True)
class Choice(Domain):
    """One member of a text enum, written as its value."""
    kind: type[TextEnum] = TextEnum
    what: str = ""
    plan_extra: tuple[str, ...] = ()    # plan-record values beyond the enum's (recompute: per-layer)

    def from_text(self, key: str, raw: str) -> TextEnum:
        try:
            return self.kind(raw)
        except ValueError:
            raise DomainError(f"{key}={raw}", self.what) from None

    def from_value(self, key: str, value: Any) -> TextEnum:
        if not isinstance(value, str):
            raise DomainError(f"{key}={value!r}", self.what)
        return self.from_text(key, str(value))

    def plan_annotation(self) -> Any:
        from typing import Annotated
        from pydantic import Field
        if self.plan_extra:
            return Literal[(*self.kind.texts(), *self.plan_extra)]
        return Annotated[self.kind, Field(strict=False)]


@dataclass(frozen=True)
class Switch(Domain):
    """On or off: true/false (or 1/0) in text, a bool in the API."""

    def from_text(self, key: str, raw: str) -> bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise DomainError(f"{key}={raw}", "true or false")
        return raw.lower() in ("true", "1")

    def from_value(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise DomainError(f"{key}={value!r}", f"{key}=True or {key}=False")
        return value

    def text(self, value: bool) -> str:
        return "true" if value else "false"

    def plan_annotation(self) -> Any:
        return bool


@dataclass(frozen=True)
class Joined(Domain):
    """A sequence written as its parts joined by `separator`, checked as text (the plan file keeps the text)."""
    separator: str = "-"
    what: str = ""
    typed_what: str = ""      # what the API's sequence form expects

    def from_value(self, key: str, value: Any) -> Any:
        if isinstance(value, str):
            return self.from_text(key, value)
        if not isinstance(value, (tuple, list)) or not all(self._part_ok(p) for p in value):
            raise DomainError(f"{key}={value!r}", self.typed_what)
        return self.from_text(key, self.separator.join(str(p) for p in value))

    def _part_ok(self, part: Any) -> bool:
        return isinstance(part, str)

    def text(self, value: tuple) -> str:
        return self.separator.join(map(str, value))

    def to_plan(self, value: tuple) -> str:
        return self.text(value)

    def from_plan(self, value: str) -> tuple:
        return self.from_text("", value)

    def plan_annotation(self) -> Any:
        from typing import Annotated
        from pydantic import AfterValidator

        def known(text: str) -> str:
            try:
                self.from_text("", text)
            except DomainError as exc:
                raise ValueError(f"expected {exc.expected}") from None
            return text
        return Annotated[str, AfterValidator(known)]


@dataclass(frozen=True)
class MeshOrder(Joined):
    what: str = "the five mesh dims innermost first, each once, e.g. tp-cp-ep-dp-pp"
    typed_what: str = "a sequence of mesh dims"

    def from_text(self, key: str, raw: str) -> tuple[str, ...]:
        order = tuple(raw.split("-"))
        if sorted(order) != sorted(MEGATRON_ORDER):
            raise DomainError(f"order={raw}", self.what)
        return order


MODULES_WHAT = f"modules joined by '+', each one of {', '.join(RecomputeModule.texts())} (Megatron --recompute-modules)"


@dataclass(frozen=True)
class ModuleSet(Joined):
    separator: str = "+"
    what: str = MODULES_WHAT + ", each once"
    typed_what: str = MODULES_WHAT

    def from_text(self, key: str, raw: str) -> tuple[RecomputeModule, ...]:
        """'mla_up_proj+mlp' -> the modules in RecomputeModule order, each once."""
        names = [n.strip() for n in raw.split("+")]
        if not all(n in RecomputeModule.texts() for n in names) or len(set(names)) != len(names):
            raise DomainError(f"recompute_modules={raw}", self.what)
        return tuple(m for m in RecomputeModule if m.value in names)


@dataclass(frozen=True)
class StageCounts(Joined):
    """Decoder layers per chunk, in chunk order: counts joined by '-', a count followed by '*n' repeated n times."""
    what: str = "layer counts per chunk joined by '-', e.g. stages=0-2*7-1"
    typed_what: str = "layer counts per chunk"

    def _part_ok(self, part: Any) -> bool:
        return isinstance(part, int) and not isinstance(part, bool) and part >= 0

    def from_text(self, key: str, raw: str) -> tuple[int, ...]:
        counts: list[int] = []
        for part in raw.split("-"):
            count, _, repeat = part.partition("*")
            if not count.isdigit() or (repeat and not repeat.isdigit()) or len(part) > 12:
                raise DomainError(f"stages={raw}", self.what)
            times = int(repeat) if repeat else 1
            if len(counts) + times > MAX_CHUNKS:   # checked before the list grows
                raise DomainError(f"stages= lists more than {MAX_CHUNKS} chunks", f"at most {MAX_CHUNKS} chunks")
            counts += [int(count)] * times
        return tuple(counts)


@dataclass(frozen=True)
class LayoutField:
    """What one `Layout` attribute carries: the key users write (layout text, `--fix`, `--layout`, API
    keywords), the plan file's key (None: not in the layout record), its domain, whether the search chooses
    it, and the software stack's default where it has one."""
    key: str
    domain: Domain
    plan_key: str | None = None
    searched: bool = False       # the search chooses it where the user does not pin it
    whole: bool = False          # one of the degrees a whole layout gives (evaluate searches what is left out)
    pin: bool = True             # may be pinned (--fix); the job's own values (batch, precision) and stages not
    plan_default: bool = False   # plan files written before the field was recorded lack it: Layout's default
    # the stack's value where the user gives none (None: Layout's default); the search fills those of the
    # fields it does not choose, evaluate every one
    stack_default: Callable[[Any], Any] | None = None
    reads: str | None = None     # the Layout property that holds the user's value, where not the attribute


def declare(default: Any, field_: LayoutField):
    """A Layout attribute with its declaration (dataclasses keeps it as the field's metadata)."""
    from dataclasses import field
    return field(default=default, metadata={"layout": field_})
