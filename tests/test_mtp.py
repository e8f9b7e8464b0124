"""Multi-token prediction (DeepSeek-V3 2.2): what capture bills for the modules, against the paper's structure
and the published checkpoint; which stacks train them; where a plan puts them."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hardware_profiles.errors import UserInputError
from planner import api
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_sources import resolve_model

PLANNER = str(Path(sys.executable).with_name("planner"))


def with_mtp(name: str, modules: int = 1):
    return resolve_model(name).model_copy(update={"mtp_layers": modules})


@pytest.mark.parametrize("name,modules", [("tiny-moe", 1), ("tiny-moe", 2), ("tiny-llama", 1)])
def test_each_module_adds_a_projection_a_layer_and_the_shared_head_with_its_loss(name, modules):
    """DeepSeek-V3 2.2: module k projects [norm(h), norm(emb)] from 2d to d, runs one transformer block and the
    shared output head; so model FLOPs grow per token by 6 x 2d^2 (projection, forward and backward) + 6 x d x V
    (head) + one more block like the last, and the loss (with its fp32 logits) is computed once more."""
    cfg = resolve_model(name)
    plain, mtp = capture(cfg), capture(with_mtp(name, modules))
    d, V, s = cfg.hidden_size, cfg.vocab_size, plain.seq_len
    last_block = plain.costs_record.kind(plain.blocks[-1].kind)
    per_module = last_block.model_flops + 6 * 2 * d * d * s + 6 * d * V * s
    added = mtp.costs_record.model_flops_per_sample - plain.costs_record.model_flops_per_sample
    assert added == pytest.approx(modules * per_module, rel=1e-9)
    assert mtp.mtp_layers == modules and mtp.num_blocks == plain.num_blocks + modules
    head, plain_head = mtp.costs_record.head, plain.costs_record.head
    assert sum(op.kind == "loss" for op in head.ops) == modules + 1
    assert head.logits_fp32_bytes == (modules + 1) * plain_head.logits_fp32_bytes


def test_deepseek_v3_mtp_module_matches_the_published_checkpoint():
    """The DeepSeek-V3 checkpoint is 671B of main model and 14B of MTP module (its Hugging Face model card);
    the module's file repeats the embedding and output head it shares (2 x V x d), which a trained model does
    not hold twice. The rest is one expert layer, the projection and three norms."""
    cfg = resolve_model("deepseek-v3")
    plain, mtp = capture(cfg), capture(with_mtp("deepseek-v3"))
    shared_copies = 2 * cfg.vocab_size * cfg.hidden_size
    assert mtp.total_params - plain.total_params + shared_copies == pytest.approx(14e9, rel=0.05)


def test_stacks_without_mtp_refuse_the_model_and_megatron_places_it_last(tmp_path):
    model = with_mtp("tiny-moe")
    for stack in ("torchtitan", "parallel-planner"):
        with pytest.raises(UserInputError) as info:
            api.plan(model, device="h100-sxm", num_devices=8, global_batch=16, stack=stack)
        assert "multi-token prediction" in str(info.value) and info.value.field == "--stack"
    plan = api.evaluate(model, device="h100-sxm", num_devices=8, global_batch=16, stack="megatron-core",
                        layout="tp=1,pp=2,vp=1,dp=4,cp=1,ep=4,etp=1,mbs=1,zero=1,recompute=none")
    assert plan.mtp_layers == 1 and plan.stages[-1].layers[-1] == model.num_layers   # the MTP layer, last
    path = tmp_path / "tiny-moe-mtp.yaml"
    path.write_text(yaml.safe_dump(model.model_dump(exclude_none=True)))
    refused = subprocess.run([PLANNER, *shlex.split(f"plan --model {path} --device h100-sxm --num-devices 8 "
                                                    "--global-batch 16 --stack torchtitan")],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "multi-token prediction" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_config_json_naming_mtp_modules_says_the_transformers_class_leaves_them_out():
    """transformers' DeepSeek-V3 class builds no MTP module: a config.json with num_nextn_predict_layers is
    captured without them, and the capture notes say so rather than dropping them silently."""
    import json

    pytest.importorskip("transformers")
    from planner.graph_capture.model_sources import config_from_hf
    raw = json.loads((Path(__file__).parent / "models" / "hf" / "deepseek-v3.json").read_text())
    raw.update(num_nextn_predict_layers=1, num_hidden_layers=4)
    graph = capture(config_from_hf(raw, "deepseek-v3.json"), seq_len=256)
    assert graph.mtp_layers == 0
    assert any("num_nextn_predict_layers" in note and "not billed" in note for note in graph.capture_notes)
