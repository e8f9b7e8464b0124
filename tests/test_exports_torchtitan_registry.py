"""torchtitan exports run as printed: `python -m torchtitan.train --module M --config C ...` parsed by torchtitan
0.3's own ConfigManager (its registry's config, every override, Trainer.Config's validation: CUDA graphs beside
pipelining or expert dispatch, activation checkpointing), then the model that config builds, on meta, split by
torchtitan's own `_split_module` with the exported module names: each stage keeps the plan's layers, the
embedding on the first and the norm and output on the last, on the pipeline rank the plan costed."""
from __future__ import annotations

import shlex
from functools import lru_cache

import pytest

pytest.importorskip("tyro")
pytest.importorskip("torchdata", reason="torchtitan's Trainer imports torchdata (make test installs it)")
pytest.importorskip("datasets", reason="torchtitan's Trainer imports datasets (make test installs it)")

import torch  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module  # noqa: E402

from hardware_profiles.loader import load_stack  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.exports import torchtitan_command  # noqa: E402

FULL = "tp={tp},pp={pp},vp={vp},dp={dp},cp={cp},ep={ep},etp=1,mbs={mbs},zero={zero},recompute={rc}"
TITAN = load_stack("torchtitan")
MCORE = load_stack("megatron-core")


def layout(tp=1, pp=1, vp=1, dp=1, cp=1, ep=1, mbs=1, zero=2, rc="none", extra=""):
    return FULL.format(tp=tp, pp=pp, vp=vp, dp=dp, cp=cp, ep=ep, mbs=mbs, zero=zero, rc=rc) + extra


# (name, model, device, devices, global batch, layout, precision, stack): torchtitan's models, its layouts
PLANS = [
    ("8b-fsdp", "llama3-8b", "h100-sxm", 16, 64, layout(dp=16), "bf16", TITAN),
    ("8b-replicas", "llama3-8b", "h100-sxm", 16, 64, layout(dp=16, zero=0), "bf16", TITAN),
    ("8b-tp-pp-full", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, pp=2, dp=4, zero=3, rc="full"), "bf16", TITAN),
    ("8b-interleaved", "llama3-8b", "h100-sxm", 16, 64, layout(pp=4, vp=2, dp=4), "bf16", TITAN),
    ("8b-dualpipev", "llama3-8b", "h100-sxm", 16, 64, layout(pp=4, vp=2, dp=4, extra=",schedule=dualpipev"),
     "bf16", TITAN),
    ("8b-cp-selective", "llama3-8b", "h100-sxm", 16, 64, layout(tp=4, cp=2, dp=2, zero=3, rc="selective"),
     "bf16", TITAN),
    ("8b-uneven", "llama3-8b", "h100-sxm", 16, 64, layout(pp=4, dp=4, extra=",stages=7-9-9-7"), "bf16", TITAN),
    ("8b-embedding-alone", "llama3-8b", "h100-sxm", 16, 64, layout(pp=4, dp=4, extra=",stages=0-11-11-10"), "bf16",
     TITAN),
    ("8b-mxfp8", "llama3-8b", "b200", 16, 64, layout(pp=2, dp=8) + ",fp8_recipe=mxfp8", "fp8", MCORE),
    ("8b-megatron-zero1", "llama3-8b", "h100-sxm", 16, 64, layout(tp=2, pp=2, dp=4, zero=1), "bf16", MCORE),
    ("70b-tp-pp", "llama3-70b", "h100-sxm", 64, 128, layout(tp=8, pp=4, dp=2), "bf16", TITAN),
    ("70b-interleaved-full", "llama3-70b", "h100-sxm", 128, 128, layout(tp=8, pp=8, vp=5, dp=2, zero=3, rc="full"),
     "bf16", TITAN),
    ("70b-cp", "llama3-70b", "h100-sxm", 64, 64, layout(tp=4, cp=4, dp=4, zero=3), "bf16", TITAN),
    ("405b-pp16-vp4", "llama3-405b", "h100-sxm", 512, 512, layout(tp=8, pp=16, vp=4, dp=4, rc="full"), "bf16",
     TITAN),
    ("405b-cp", "llama3-405b", "h100-sxm", 512, 512, layout(tp=8, pp=8, cp=2, dp=4, zero=3, rc="full"), "bf16",
     TITAN),
    ("dsv3-pp8-ep8", "deepseek-v3", "h100-sxm", 256, 512, layout(pp=8, dp=32, ep=8, rc="full"), "bf16", TITAN),
    ("dsv3-tp-ep16", "deepseek-v3", "h100-sxm", 256, 512, layout(tp=2, pp=4, dp=32, ep=16, zero=3, rc="full"),
     "bf16", TITAN),
    ("dsv3-ep-no-pp", "deepseek-v3", "h100-sxm", 512, 512, layout(dp=512, ep=64, zero=3, rc="full"), "bf16", TITAN),
    ("dsv3-fp8", "deepseek-v3", "h100-sxm", 256, 512, layout(pp=8, dp=32, ep=8, rc="full"), "fp8", TITAN),
    ("qwen3-ep", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(dp=16, ep=8), "bf16", TITAN),
    ("qwen3-tp-pp-full", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(tp=2, pp=2, dp=4, ep=4, zero=3, rc="full"),
     "bf16", TITAN),
    ("qwen3-interleaved", "qwen3-30b-a3b", "h100-sxm", 16, 64, layout(pp=4, vp=2, dp=4, ep=4), "bf16", TITAN),
]
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "dualpipev": "DualPipeV"}
AC = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}


@pytest.fixture(autouse=True)
def fp8_capable_machine(monkeypatch):
    """torchtitan's FP8 converters check the GPU they would run on when the config is parsed (SM89 for float8,
    SM100 for MXFP8); the config is what is checked here, on a CPU machine."""
    from torchtitan.components.quantization import float8, mx
    for module in (float8, mx):
        monkeypatch.setattr(module, "has_cuda_capability", lambda major, minor: True)


@lru_cache(maxsize=None)
def built(module: str, config: str) -> torch.nn.Module:
    """The model torchtitan builds from its registry config, on meta (no memory, no weights)."""
    spec = ConfigManager().parse_args(["--module", module, "--config", config, "--training.disable_cuda_graphs"])
    with torch.device("meta"):
        return spec.model_spec.model.build()


@pytest.mark.parametrize("case", PLANS, ids=[c[0] for c in PLANS])
def test_torchtitan_runs_the_export_as_printed(case):
    name, model, device, count, batch, text, precision, stack = case
    plan = evaluate(model, device=device, num_devices=count, global_batch=batch, layout=text, precision=precision,
                    stack=stack)
    command, notes = torchtitan_command(plan)
    words = shlex.split(command.replace("\\\n", " "))   # as the shell joins continued lines
    assert words[:3] == ["python", "-m", "torchtitan.train"]
    if "CONFIG" in words:   # the registry has this model only in FP8: the note says so, the FP8 config stands in
        assert "only in FP8" in notes[0]
        words[words.index("CONFIG")] = notes[0].split("(")[1].split(",")[0]
    config = ConfigManager().parse_args(words[3:])   # torchtitan's registry config, overrides and validation
    lay, par, training = plan.layout, config.parallelism, config.training
    dims = ParallelDims.from_config(par, count)
    assert (dims.tp, dims.cp, dims.pp, dims.ep) == (lay.tp, lay.cp, lay.pp, lay.ep)
    assert dims.dp_replicate * dims.dp_shard == lay.dp and (dims.dp_shard > 1 or lay.dp == 1) == (lay.zero >= 1)
    if lay.zero >= 1:
        assert get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, dims.pp_enabled) == (lay.zero >= 3)
    assert training.seq_len == plan.seq_len and training.global_batch_size == lay.gbs
    assert training.disable_cuda_graphs == (lay.pp > 1 or lay.ep > 1)
    kinds = {r for stage in plan.stages for r in stage.recompute}
    assert isinstance(config.activation_checkpoint, AC["none" if kinds == {"none"} else (
        "selective" if kinds == {"selective"} else "full")])
    if precision == "fp8":   # the registry's FP8 config where it has one for the recipe, else the converter named
        assert any("FP8" in note and "Converter" in note for note in notes)
    if lay.pp > 1:
        check_the_split(plan, config, words[words.index("--module") + 1], words[words.index("--config") + 1])


def check_the_split(plan, config, module: str, name: str) -> None:
    """torchtitan's own split of the model its config builds, by the exported names, is the plan's split."""
    par, lay = config.parallelism, plan.layout
    assert par.pipeline_parallel_schedule == SCHEDULES[lay.schedule]
    assert config.training.local_batch_size // par.pipeline_parallel_microbatch_size == lay.gbs // (lay.dp * lay.mbs)
    model = built(module, name)
    assert len(model.layers) == sum(len(stage.layers) for stage in plan.stages) - plan.mtp_layers
    last = len(plan.stages) - 1
    for j, (stage, names) in enumerate(zip(plan.stages, par.module_fqns_per_model_part)):
        part = _split_module(model, names)
        assert sorted(int(key) for key in part.layers.keys()) == list(stage.layers)
        assert (part.tok_embeddings is not None) == (j == 0)
        assert (part.norm is not None) == (part.lm_head is not None) == (j == last)
    for rank in range(lay.pp):   # torchtitan places the stages where the plan costed them (looped, or a V)
        assert list(_get_pp_rank_to_stage_indices_mapping(rank, lay.pp, par.pipeline_parallel_schedule,
                                                          len(plan.stages))) \
            == [stage.index for stage in plan.stages if stage.pipeline_rank == rank]


def test_a_model_torchtitan_does_not_have_leaves_module_and_config_to_fill_and_says_so():
    plan = evaluate("mixtral-8x7b", device="h100-sxm", num_devices=16, global_batch=64,
                    layout=layout(pp=2, dp=8, ep=8), stack=TITAN)
    command, notes = torchtitan_command(plan)
    assert "--module MODULE --config CONFIG" in command
    assert "one thing left to fill" in notes[0]
