"""Full recomputation of the first N layers of each pipeline chunk (layout key `recompute_layers`, Megatron's
`--recompute-granularity full --recompute-method block --recompute-num-layers N`), checked against a brute force
over every partition, Megatron-Core's own config and the export's round trip."""
from __future__ import annotations

import itertools
import warnings
from dataclasses import replace

import pytest

import planner
from cost_models.layout import Layout, Recompute
from cost_models.layout_codec import parse_text, text_of
from cost_models.pipeline import least_blocks, partition_problem
from cost_models.step_time import estimate
from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import cluster_from_device, load_stack
from planner.job import capture_for
from planner.exports import megatron_args
from tests.test_exports_megatron import flags
from tests.test_search import mixed_moe_model

PINS = "tp=1,pp=2,vp=2,dp=8,cp=1,ep=2,etp=1,mbs=1,zero=1,recompute=full"


def megatron_block_method(stage_layers: tuple[int, ...], count: int) -> tuple[Recompute, ...]:
    """TransformerBlock._checkpointed_forward with recompute_method 'block': in each chunk's own layer loop,
    layer l is checkpointed when l < recompute_num_layers (Megatron-Core 0.16.1, transformer_block.py)."""
    out = []
    for blocks in stage_layers:
        out += [Recompute.full if layer < count else Recompute.none for layer in range(blocks)]
    return tuple(out)


def every_partition(num_blocks: int, chunks: int):
    for cuts in itertools.combinations_with_replacement(range(num_blocks + 1), chunks - 1):
        sizes = tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_blocks)))
        if all(n >= least_blocks(j, chunks) for j, n in enumerate(sizes)) \
                and partition_problem(sizes, num_blocks, chunks) is None:
            yield sizes


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_plan_is_the_best_partition_a_brute_force_finds_with_megatrons_block_method(count):
    """Every degree pinned, the split searched: a model of two kinds (4 dense layers, then 4 MoE), where which
    kinds a chunk's first N layers are depends on where the chunk starts, so the solver's counts must follow the
    positions, as Megatron's loop does. (`evaluate` of the whole layout splits evenly, as Megatron does.)"""
    model = mixed_moe_model(seq=1024)
    planned = planner.plan(model, device="h100-sxm", num_devices=16, global_batch=32, tp=1, pp=2, vp=2, dp=8, cp=1,
                           ep=2, etp=1, mbs=1, zero=1, recompute="full", recompute_layers=count, dispatcher="alltoall")
    sizes = tuple(len(s.layers) for s in planned.stages)
    assert [r for s in planned.stages for r in s.recompute] == [r.value for r in megatron_block_method(sizes, count)]
    stack = load_stack()
    graph, cluster = capture_for(model, None, (), stack), cluster_from_device("h100-sxm", 16)   # as plan captures
    base = Layout(dp=8, pp=2, vp=2, ep=2, global_batch=32, zero=1, recompute=Recompute.full)
    times = {sizes: estimate(graph.costs(), cluster, replace(base, stage_layers=sizes,
                                                             layer_recompute=megatron_block_method(sizes, count)),
                             stack).step_time_s
             for sizes in every_partition(graph.num_blocks, 4)}
    assert len(times) > 20
    assert planned.step_time_s == pytest.approx(min(times.values()), rel=1e-6)


def test_given_stages_take_the_first_layers_of_each_chunk_and_export_as_megatron_reads_them():
    """An uneven split (3, 1, 2, 2) with N = 2: chunks of fewer layers recompute all of theirs, as Megatron's loop
    does; the export says block and 2, with no note, and Megatron-Core's TransformerConfig takes the flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = mixed_moe_model(seq=1024)
    plan = planner.evaluate(model, device="h100-sxm", num_devices=16, global_batch=32,
                            layout=f"{PINS},recompute_layers=2,stages=3-1-2-2")
    assert [s.recompute for s in plan.stages] == [["full", "full", "none"], ["full"], ["full", "full"],
                                                  ["full", "full"]]
    args, notes = megatron_args(plan)
    exported = flags(args)
    assert (exported["--recompute-granularity"], exported["--recompute-method"],
            exported["--recompute-num-layers"]) == ("full", "block", "2")
    assert [note for note in notes if "CUDA_DEVICE_MAX_CONNECTIONS" not in note] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=8, hidden_size=64, num_attention_heads=4,
                                   recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert config.recompute_num_layers == 2
    written = text_of(Layout(dp=8, pp=2, vp=2, ep=2, recompute=Recompute.full, recompute_layers=2))
    assert parse_text(written)["recompute_layers"] == 2 and "recompute_layers=2" in written


@pytest.mark.parametrize("layout,stack,says", [
    ("tp=1,pp=2,dp=8,ep=2,recompute=selective,recompute_layers=2", None, "recompute_layers=2 needs recompute=full"),
    ("tp=1,pp=2,dp=8,ep=2,recompute=full,recompute_layers=0", None, "recompute_layers >= 1"),
    ("tp=1,pp=2,dp=8,recompute=full,recompute_layers=2", "megatron-lm-2021",
     "the megatron-lm-2021 stack recomputes every layer or none"),
])
def test_what_the_block_method_cannot_mean_is_refused(layout, stack, says):
    with pytest.raises(UserInputError, match=says):
        planner.evaluate(mixed_moe_model(seq=1024) if stack is None else "llama3-8b", device="h100-sxm",
                         num_devices=16, global_batch=32, layout=layout, stack=stack)


def test_evaluate_splits_evenly_and_recomputes_the_first_layers_of_each_chunk():
    plan = planner.evaluate(mixed_moe_model(seq=1024), device="h100-sxm", num_devices=16, global_batch=32,
                            layout=f"{PINS},recompute_layers=1")
    assert [s.recompute for s in plan.stages] == [["full", "none"]] * 4


def test_a_searched_per_block_recomputation_is_written_as_text_that_means_it_again():
    """Every per-block recomputation over small stage splits (chunks of 1-3 blocks, 6 at most; none, full and
    selective): the layout text says it where the text can (one method everywhere, or Megatron's block method,
    found here by trying every N), parses back to a layout whose blocks recompute exactly so, and says
    'per-layer' (a plan file's stages) for every other list."""
    methods = (Recompute.none, Recompute.full, Recompute.selective)
    splits = itertools.chain.from_iterable(itertools.product((1, 2, 3), repeat=n) for n in (1, 2, 3))
    for split in (s for s in splits if sum(s) <= 6):
        for blocks in itertools.product(methods, repeat=sum(split)):
            base = Layout(dp=4, pp=len(split), stage_layers=split, layer_recompute=blocks)
            values = dict(item.split("=") for item in text_of(base).split(","))
            expressible = len(set(blocks)) == 1 or any(
                blocks == tuple(Recompute.full if i < n else Recompute.none for size in split for i in range(size))
                for n in range(1, max(split)))
            if not expressible:
                assert values["recompute"] == "per-layer"
                continue
            parsed = parse_text(",".join(f"{k}={v}" for k, v in values.items() if k != "pp") + f",pp={len(split)}")
            again = replace(Layout(dp=4, pp=len(split)), recompute=Recompute(parsed["recompute"]),
                            recompute_layers=parsed.get("recompute_layers"))
            assert again.block_recompute(split) == blocks, (split, blocks, values)
