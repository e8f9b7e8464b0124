"""The placement the planner chooses where the user states none (planner/placement.py), against enumeration: on a
multi-node scale-up domain (GB200 NVL72: 18 nodes of 4), the plan is the fastest of the plans searched on each
placement it tries (packing, and each equal segment), and says what the others gave; a stated placement (a
segment, or a whole domain's count for packing) is kept and not searched."""
import pytest

import planner
from hardware_profiles import load_cluster
from planner.placement import placement_choices

pytestmark = pytest.mark.heavy

JOB = dict(global_batch=320, seq_len=4096, time_limit_s=120)
GB200 = load_cluster("gb200-nvl72")


def test_placements_tried_are_packing_and_the_largest_equal_segments():
    assert [c.segment_devices for c in placement_choices(GB200.with_devices(160))] == [None, 40, 32]  # 40 nodes
    assert [c.segment_devices for c in placement_choices(GB200.with_devices(144))] == [None]   # two whole racks
    assert [c.segment_devices for c in placement_choices(GB200.with_devices(64))] == [None]    # inside one rack
    assert len(placement_choices(load_cluster("dgx-h100").with_devices(64))) == 1             # a node per domain


def test_the_chosen_placement_is_the_fastest_of_each_stated_one():
    chosen = planner.plan("mixtral-8x7b", "gb200-nvl72", num_devices=160, **JOB)
    stated = {segment: planner.plan("mixtral-8x7b", "gb200-nvl72", num_devices=160, segment_devices=segment, **JOB)
              for segment in (72, 40, 32)}   # 72: packed, stated
    assert chosen.step_time_s == min(plan.step_time_s for plan in stated.values())
    fastest = min(stated, key=lambda segment: stated[segment].step_time_s)
    assert chosen.segment_devices == (None if fastest == 72 else fastest)
    said = [reason for reason in chosen.reasons if reason.startswith("placement chosen by the search")]
    assert len(said) == 1 and all(f"{stated[s].step_time_s:.3f} s" in said[0] for s in stated if s != fastest)
    for plan in stated.values():
        assert not any(reason.startswith("placement chosen") for reason in plan.reasons)
    assert stated[72].segment_devices is None   # packing exports no --segment
