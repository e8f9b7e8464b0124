"""One layout vocabulary: each layout field is declared once, on `Layout`, and every other form of it (the
layout text, the API keywords, the search's pins, the plan file's record) is derived from that declaration."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from cost_models.layout import Layout
from cost_models.layout_codec import FIELDS, FULL_KEYS, LAYOUT_KEYS, layout_from, parse_text, text_of, values_of
from planner.plans import LayoutRecord
from planner.rules.pins import PIN_KEYS, Pins

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for package in ("cost_models", "hardware_profiles", "planner", "runtime")
           for p in sorted((ROOT / package).rglob("*.py"))]


def _declarations() -> dict[str, set[str]]:
    """Every class in the sources with the names its body declares as annotated fields."""
    found = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {item.target.id for item in node.body
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
                found[f"{path.relative_to(ROOT)}:{node.name}"] = names
    return found


def test_each_field_is_declared_once_on_layout():
    """The declarations: every key, attribute and plan key once, and each on a Layout attribute."""
    declared = [item for item in fields(Layout) if "layout" in item.metadata]
    keys = [item.metadata["layout"].key for item in declared]
    plan_keys = [item.metadata["layout"].plan_key for item in declared if item.metadata["layout"].plan_key]
    assert len(keys) == len(set(keys)) and len(plan_keys) == len(set(plan_keys))
    assert tuple(keys) == LAYOUT_KEYS
    assert {FIELDS[key].attribute for key in keys} == {item.name for item in declared}


def test_no_class_declares_the_vocabulary_again():
    """A second declaration of a layout field is a class with fields named by the users' keys or the plan
    file's keys (as Pins, LayoutRecord and ParallelDims were), or one restating most of Layout's fields.
    Classes may hold values taken from a layout under Layout's own attribute names (the search's nodes, the
    compute model's shard spec): those are readings, not the vocabulary."""
    written = {key for key, d in FIELDS.items() if key != d.attribute} | \
        {d.field.plan_key for d in FIELDS.values() if d.field.plan_key and d.field.plan_key != d.attribute}
    attributes = {d.attribute for d in FIELDS.values()}
    # the plan keeps the split (`stages`) as its stage records, beside the layout record
    own_forms = {"cost_models/layout.py:Layout": set(), "planner/plans.py:Plan": {"stages"}}
    for name, names in _declarations().items():
        if name in own_forms:
            assert names & written <= own_forms[name]
            continue
        assert not names & written, f"{name} declares layout fields by their keys: {sorted(names & written)}"
        assert len(names & attributes) <= len(attributes) // 2, f"{name} restates Layout: {sorted(names & attributes)}"


def test_derived_forms_follow_the_declarations():
    """Pins are the pinnable keys, the plan record the plan keys, and the text round-trips every whole layout."""
    assert PIN_KEYS == tuple(key for key, d in FIELDS.items() if d.field.pin)
    assert {f for f in fields(Pins)} and all(hasattr(Pins(), key) for key in PIN_KEYS)
    assert [k for k in LayoutRecord.model_fields if k in {d.field.plan_key for d in FIELDS.values()}] == \
        [d.field.plan_key for d in FIELDS.values() if d.field.plan_key]
    whole = parse_text("tp=2,pp=4,dp=8,cp=2,ep=4,etp=2,vp=2,mbs=2,zero=3,recompute=full,order=tp-dp-cp-ep-pp")
    layout = layout_from(whole, global_batch=64)
    assert parse_text(text_of(layout)) == whole
    assert set(FULL_KEYS) <= set(values_of(layout))


@pytest.mark.parametrize("text", ["tp=𝟐", "tp=2_0", "tp= 2x", "zero=1e0", "vp=-1", "stages=1*99999999"])
def test_numbers_are_ascii_digits_and_bounded(text):
    """A degree is decimal ASCII digits (int() would take '2_0' and other scripts' digits); a stage list is
    refused before it is built past its limit."""
    from hardware_profiles.errors import UserInputError
    with pytest.raises(UserInputError):
        parse_text(text)
