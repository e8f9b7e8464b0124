"""Pipeline layouts as frameworks allow them (issue 21): the embedding and the loss as chunks' work, any
per-chunk layer counts, checked with Megatron-Core's own parser of --pipeline-model-parallel-layout."""
import warnings

import pytest

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
    from planner.capture.model_config import ModelConfig
    model = ModelConfig(name="wide-vocab", num_layers=6, hidden_size=1024, num_attention_heads=8,
                        ffn_hidden_size=4096, vocab_size=512000, seq_length=2048)
    result = plan(model, device="h100-sxm", num_devices=8, global_batch=32, tp=1, pp=8, dp=1)
    counts = [len(s.layers) for s in result.stages]
    assert counts[0] == 0 and counts[-1] == 0 and sum(counts) == 6
