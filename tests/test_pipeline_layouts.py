"""Pipeline layouts as frameworks allow them (issue 21): the embedding and the loss as chunks' work, any
per-chunk layer counts, checked with Megatron-Core's own parser of --pipeline-model-parallel-layout."""
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.layout_codec import parse_text
from cost_models.pipeline import even_partition, partition_problem
from hardware_profiles import UserInputError
from planner.api import evaluate, plan
from planner.exports import megatron_args, megatron_pipeline_layout

LLAMA_405B = dict(device="h100-sxm", num_devices=256, global_batch=64, seq_len=8192)   # 126 layers


def megatron_layout(text: str, pp: int):
    """Megatron-Core's own parser of --pipeline-model-parallel-layout (megatron-core, a test extra)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Transformer Engine and Apex are not installed"
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    return PipelineParallelLayerLayout(text, pp)


def decoder():
    from megatron.core.transformer.enums import LayerType
    return LayerType.decoder


def test_more_chunks_than_layers_count_embedding_and_loss_as_layers():
    """Megatron-Core's account_for_embedding/loss_in_pipeline_split: 126 layers + embedding + loss fill
    128 chunks one each, so the first chunk holds only the embedding and the last only the loss."""
    assert even_partition(126, 128) == (0,) + (1,) * 126 + (0,)
    assert even_partition(126, 127) == (1,) * 126 + (0,)
    assert even_partition(8, 4) == (2, 2, 2, 2)
    assert partition_problem((0, 2, 2, 0), 4, 4) is None
    assert "hold nothing" in partition_problem((1, 0, 2, 1), 4, 4)


def test_llama3_405b_pp16_vp8_evaluates_plans_and_exports_as_megatron_parses_it():
    """tp4 x pp16 x vp8 on 256 GPUs (128 virtual chunks for 126 layers) was refused with 'no layout of 256
    devices divides this model'. It evaluates, plans, and its Megatron layout is what Megatron-Core's parser
    reads back: every (pipeline rank, virtual stage) builds the plan's decoder layers."""
    layout = "tp=4,pp=16,vp=8,dp=4,cp=1,ep=1,etp=1,mbs=1,zero=1,recompute=full"
    given = evaluate("llama3-405b", layout=layout, **LLAMA_405B)
    assert [len(s.layers) for s in given.stages] == [0] + [1] * 126 + [0]
    planned = plan("llama3-405b", tp=4, pp=16, vp=8, dp=4, **LLAMA_405B)
    assert planned.search.status == "complete" and planned.step_time_s <= given.step_time_s * (1 + 1e-9)
    for result in (given, planned):
        text = megatron_pipeline_layout(result)
        parsed = megatron_layout(text, 16)
        assert parsed.virtual_pipeline_model_parallel_size == 8
        parsed.validate_layer_layout(num_layers=126, mtp_num_layers=None)
        for stage in result.stages:
            vp_stage, pp_rank = divmod(stage.index, 16)
            assert parsed.layout[pp_rank][vp_stage].count(decoder()) == len(stage.layers)
        assert any(arg.startswith("--pipeline-model-parallel-layout") for arg in megatron_args(result)[0])


def test_evaluate_takes_any_per_chunk_layout():
    """stages= gives decoder layers per chunk; the prediction is that split's, and a split a framework
    would refuse is refused with the rule."""
    base = "tp=8,pp=4,vp=2,dp=1,cp=1,ep=1,etp=1,mbs=1,zero=1,recompute=full"
    shape = dict(device="h100-sxm", num_devices=32, global_batch=8)
    uneven = evaluate("llama3-8b", layout=base + ",stages=0-5-5-5-5-5-5-2", **shape)
    assert [len(s.layers) for s in uneven.stages] == [0, 5, 5, 5, 5, 5, 5, 2]
    assert uneven.stages[0].modules[0] == uneven.stages[0].modules[-1]   # the embedding alone
    even = evaluate("llama3-8b", layout=base, **shape)
    assert uneven.step_time_s != even.step_time_s
    with pytest.raises(UserInputError, match="hold nothing"):
        evaluate("llama3-8b", layout=base + ",stages=4-0-4-4-4-4-4-8", **shape)
    with pytest.raises(UserInputError, match="do not split 32 layers"):
        evaluate("llama3-8b", layout=base + ",stages=5*8", **shape)
    assert parse_text("stages=0-1*126-0")["stages"] == (0,) + (1,) * 126 + (0,)


def test_plan_may_leave_the_embedding_or_the_loss_alone_in_its_chunk():
    """With a huge vocabulary the embedding and the output layer are a layer's worth of work or more: the
    searched split puts fewer decoder layers beside them, down to none, where that balances the stages."""
    from planner.graph_capture.model_config import ModelConfig
    model = ModelConfig(name="wide-vocab", num_layers=6, hidden_size=1024, num_attention_heads=8,
                        ffn_hidden_size=4096, vocab_size=512000, seq_length=2048)
    result = plan(model, device="h100-sxm", num_devices=8, global_batch=32, tp=1, pp=8, dp=1)
    counts = [len(s.layers) for s in result.stages]
    assert counts[0] == 0 and counts[-1] == 0 and sum(counts) == 6


def test_a_stack_that_splits_layers_evenly_is_planned_and_checked_as_megatron_lm_asserts_it():
    """Megatron-LM of 2021-2022 asserts num_layers % pp == 0 (and per-stage layers % vp == 0): over every
    pp x vp the search may take for 10 layers on 8 devices, the plan's and each evaluated split are even,
    and a pp that does not divide the layers is refused with the rule. The search against enumeration:
    the plan is the fastest of the even layouts evaluated one by one."""
    from planner.graph_capture.model_config import ModelConfig
    model = ModelConfig(name="ten-layers", num_layers=10, hidden_size=1024, num_attention_heads=8,
                        ffn_hidden_size=4096, vocab_size=51200, seq_length=1024, activation="gelu",
                        normalization="layernorm", position_embedding="learned", dropout=0.0)
    shape = dict(device="a100-80g", num_devices=8, global_batch=16, seq_len=1024, stack="megatron-lm-2021")
    fixed = dict(tp=2, dp=8 // 2, mbs=1, zero=0, recompute="none")
    with pytest.raises(UserInputError, match="splits the layers evenly"):
        evaluate(model, layout=dict(fixed, tp=1, pp=4, dp=2), **shape)
    with pytest.raises(UserInputError, match="splits the layers evenly"):
        evaluate(model, layout=dict(fixed, tp=1, pp=2, dp=4, cp=1, ep=1, etp=1, vp=1, stages="4-6"), **shape)
    times = {}
    for pp, vp in [(1, 1), (2, 1), (2, 5)]:   # the pp x vp dividing 10 with tp 2 x dp on 8 devices
        result = evaluate(model, layout=dict(fixed, pp=pp, dp=8 // (2 * pp), vp=vp), **shape)
        assert {len(s.layers) for s in result.stages} == {10 // (pp * vp)}   # per chunk
        times[pp, vp] = result.step_time_s
    best = plan(model, tp=2, mbs=1, zero=0, recompute="none", **shape)
    assert {len(s.layers) for s in best.stages} == {10 // (best.layout.pp * best.layout.vp)}
    assert best.step_time_s == pytest.approx(min(times.values()), rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(2, 24), pp=st.sampled_from([1, 2, 4, 8]), vp=st.integers(1, 4))
def test_every_pipeline_split_megatron_lm_refuses_is_refused_and_every_other_is_even(layers, pp, vp):
    """Property over the layer counts, pp and vp a user may give the megatron-lm-2021 stack: refused with the
    even-split rule exactly where pp x vp does not divide the layers, else every chunk holds as many layers."""
    from planner.graph_capture.model_config import ModelConfig
    model = ModelConfig(name=f"tiny-{layers}", num_layers=layers, hidden_size=256, num_attention_heads=4,
                        ffn_hidden_size=1024, vocab_size=1024, seq_length=256, activation="gelu",
                        normalization="layernorm", position_embedding="learned", dropout=0.0)
    layout = dict(tp=1, pp=pp, dp=8 // pp, vp=vp, mbs=1, zero=0, recompute="none")
    shape = dict(device="a100-80g", num_devices=8, global_batch=8 * 8, seq_len=256, stack="megatron-lm-2021")
    if vp > 1 and pp == 1:
        return   # no interleaving without a pipeline: a rule of its own
    try:
        result = evaluate(model, layout=layout, **shape)
    except UserInputError as refused:
        assert (layers % (pp * vp) != 0) == ("splits the layers evenly" in str(refused)), str(refused)
        return
    assert layers % (pp * vp) == 0
    assert {len(s.layers) for s in result.stages} == {layers // (pp * vp)}


def torch_interleaved_peak(pp: int, vp: int, micro_batches: int) -> list[float]:
    """Chunk forwards each rank holds at its peak in torch's own ScheduleInterleaved1F1B order (the runtime's
    schedule), in stage units (v chunks make a stage)."""
    from torch.distributed.pipelining import schedules
    schedule = schedules.ScheduleInterleaved1F1B.__new__(schedules.ScheduleInterleaved1F1B)   # no process group
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, vp, micro_batches
    schedule.number_of_rounds = max(1, micro_batches // pp)
    schedule.microbatches_per_round = micro_batches // schedule.number_of_rounds
    peaks = []
    for rank in range(pp):
        held = peak = 0
        for action in filter(None, schedule._calculate_single_rank_operations(rank)):
            kind = str(action.computation_type)
            held += 1 if kind in ("F", "_ComputationType.FORWARD") else -1 if "B" in kind else 0
            peak = max(peak, held)
        peaks.append(peak / vp)
    return peaks


@pytest.mark.parametrize("pp,vp,micro_batches", [(4, 2, 8), (4, 3, 12), (8, 4, 16), (2, 2, 2), (4, 2, 16)])
def test_interleaved_ranks_hold_what_torch_and_megatron_schedules_hold(pp, vp, micro_batches):
    """Every rank of the interleaved schedule, not only the first (Korthikanti et al.'s p + (p-1)/v): torch's
    own action list, and Megatron-Core's warm-up count (+1 forward before the first backward), whose combined
    1F1B (MoE all-to-all overlap) runs one more warm-up forward."""
    from types import SimpleNamespace

    from cost_models.pipeline import in_flight_micro_batches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    expected = torch_interleaved_peak(pp, vp, micro_batches)
    assert [in_flight_micro_batches(r, pp, micro_batches, vp) for r in range(pp)] == pytest.approx(expected)
    for rank in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r)
        for paired in (False, True):
            _, _, warmup, _ = get_pp_rank_microbatches(
                micro_batches, vp, pp, overlap_moe_expert_parallel_comm=paired,
                p2p_communicator=SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp))
            held = min(warmup + 1, micro_batches * vp) / vp
            assert in_flight_micro_batches(rank, pp, micro_batches, vp, paired) == pytest.approx(held)
    # combined 1F1B pairs what rank 0 neither warms up nor cools down with (as Megatron-Core counts them)
    from cost_models.pipeline import combined_1f1b_paired_share
    group = SimpleNamespace(size=lambda: pp, rank=lambda: 0)
    total, _, warmup, remaining = get_pp_rank_microbatches(
        micro_batches, vp, pp, overlap_moe_expert_parallel_comm=True,
        p2p_communicator=SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp))
    assert combined_1f1b_paired_share(pp, vp, micro_batches) == pytest.approx(remaining / total)
    # 1F1B without interleaving, and no pipeline (combined 1F1B: the next forward beside this backward)
    assert [in_flight_micro_batches(r, 4, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(0, 1, 8, 1, paired=True) == 2 and in_flight_micro_batches(0, 1, 1, 1, True) == 1
