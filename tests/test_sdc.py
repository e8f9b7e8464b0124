"""Silent data corruption in computation (runtime/gemm_check.py, runtime/optimizer_check.py): an element of one
matrix product of one rank's forward or backward comes out wrong (`--inject sdc@3:R`, AdamW, every product checked: `--gemm-every 1`), under
dp2 ZeRO-1, dp2 ZeRO-3, tp2 x dp2 and pp2 x dp2. The check names the rank in one `health:` line before any
optimizer step uses the step's gradients, the batch is skipped on every rank, and the losses are those of the run
that skipped that batch and never had the fault. An error below the check's limit of detection passes, and the
limit the run states at its first check is above it: reported, not hidden. The tolerance's margin over clean
rounding, in fp32 and bf16, is checked on the products of a real transformers Llama.

A wrong optimizer update of the shard a rank owns (`--inject optsdc@3:1`, every owned element sampled): the
neighbour's recomputation names the owner, the job rolls back to the checkpoint of step 2 and skips batch 3, and
the later losses are those of the run that skipped batch 3; without checkpoints it stops, saying why.
"""
import json
import math

import pytest
import torch

from test_runtime import LOSS_TOLERANCE, launch

pytestmark = pytest.mark.heavy

TRAIN = ("--model", "tiny-llama", "--optimizer", "adamw", "--lr", "0.001", "--steps", "4")
FAULT = {"inject": "sdc@3:1", "gemm_every": 1}


def by_case(stdout: str) -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("begin case "):
            current = line.split()[-1]
            cases[current] = []
        elif current:
            cases[current].append(line)
    return cases


def losses(lines: list[str]) -> dict[int, float]:
    return {int(line.split()[3]): float(line.split()[-1]) for line in lines if line.startswith("case ")}


def run(nproc: int, cases: list[dict], tmp_path, stops: bool = False) -> dict[str, list[str]]:
    """Every case in one launch, which fails where the health policy `stops` one (torchrun: exit 1)."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = launch(nproc, *TRAIN, "--cases", str(spec), check=False)
    assert (proc.returncode != 0) == stops, proc.stderr[-3000:]
    cases = by_case(proc.stdout)
    cases["stderr"] = proc.stderr.splitlines()
    return cases


def assert_named_and_skipped(lines: list[str], reference: list[str], rank: int, phase: str) -> None:
    said = [line for line in lines if line.startswith("health: step")]
    assert len(said) == 1 and said[0].startswith(
        f"health: step 3: a matrix product computed wrong (silent data corruption in computation) on rank {rank}: "
        f"a {phase} product"), lines
    got, expected = losses(lines), losses(reference)
    assert sorted(expected) == [1, 2, 4]
    assert all(abs(got[step] - expected[step]) < LOSS_TOLERANCE for step in expected), (got, expected)


def test_a_wrong_product_is_named_and_its_batch_skipped_on_two_ranks(tmp_path):
    cases = run(2, [
        {"name": "reference", "layout": "dp=2,zero=1", "skip_steps": "3"},
        {"name": "zero1-forward", "layout": "dp=2,zero=1", **FAULT},
        {"name": "zero3-backward", "layout": "dp=2,zero=3", **FAULT, "sdc_phase": "backward"},
        {"name": "below-limit", "layout": "dp=2,zero=1", **FAULT, "sdc_error": 1e-7},
    ], tmp_path)
    assert_named_and_skipped(cases["zero1-forward"], cases["reference"], 1, "forward")
    assert_named_and_skipped(cases["zero3-backward"], cases["reference"], 1, "backward")
    below = cases["below-limit"]
    assert not [line for line in below if line.startswith("health: step")]   # it passes unseen...
    stated = next(line for line in below if line.startswith("note: matrix products checked every 1 steps"))
    limit = float(stated.split("an error under ")[1].split()[0])
    assert 1e-7 < limit < 1e-2   # ...below the limit the run states


def test_a_wrong_product_is_named_under_tensor_and_pipeline_parallelism(tmp_path):
    cases = run(4, [
        {"name": "reference", "layout": "tp=2,dp=2", "skip_steps": "3"},
        {"name": "tp2-dp2-forward", "layout": "tp=2,dp=2", **FAULT},
        {"name": "pp2-dp2-backward", "layout": "pp=2,dp=2,mbs=1", **FAULT, "inject": "sdc@3:3",
         "sdc_phase": "backward"},
    ], tmp_path)
    assert_named_and_skipped(cases["tp2-dp2-forward"], cases["reference"], 1, "forward")
    assert_named_and_skipped(cases["pp2-dp2-backward"], cases["reference"], 3, "backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clean_products_stay_well_inside_the_tolerance_and_a_doubled_element_does_not(dtype):
    """transformers' Llama (not this project's model), forward and backward: every clean product's checksum
    discrepancy is under a quarter of the tolerance; one element doubled in any of the first products of either
    phase is over it (bf16 autocast: bf16 products, fp32 accumulation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.gemm_check import GemmCheck, GemmFault
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    tokens = torch.randint(0, 256, (4, 64))

    def step(fault=None):
        check = GemmCheck()
        with check.watching(fault), torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            model(tokens, labels=tokens).loss.backward()
        return check.verdict()
    clean = max(step().ratio for _ in range(3))
    assert clean < 0.25
    for phase in ("forward", "backward"):
        for index in (1, 2, 5):
            verdict = step(GemmFault(phase, 1.0, index))
            assert verdict.wrong and verdict.phase == phase and math.isfinite(verdict.ratio)


def optimizer_cases(tmp_path, layouts: dict[str, str], rank: int) -> list[dict]:
    return [{"name": name, "layout": layout, "inject": f"optsdc@3:{rank}", "optimizer_check_samples": 0,
             "optimizer_check_every": 1,
             "checkpoint_dir": str(tmp_path / name), "save_every": "2"} for name, layout in layouts.items()]


def assert_rolled_back(lines: list[str], reference: list[str], rank: int) -> None:
    said = [line for line in lines if line.startswith("health: step")]
    assert said == [f"health: step 3: the optimizer update of rank {rank} differs from its recomputation by another "
                    "rank (silent data corruption in computation); policy rollback",
                    "health: step 3: rolled back to step 2 (its checkpoint); batch 3 skipped"], lines
    got, expected = losses(lines), losses(reference)
    assert all(abs(got[step] - expected[step]) < LOSS_TOLERANCE for step in expected), (got, expected)


def test_a_wrong_optimizer_update_is_named_and_rolled_back_on_two_ranks(tmp_path):
    cases = run(2, [{"name": "reference", "layout": "dp=2,zero=1", "skip_steps": "3"},
                    *optimizer_cases(tmp_path, {"zero1": "dp=2,zero=1", "zero3": "dp=2,zero=3"}, 1),
                    {**optimizer_cases(tmp_path, {"below-limit": "dp=2,zero=1"}, 1)[0], "sdc_error": 1e-8},
                    {"name": "no-checkpoints", "layout": "dp=2,zero=1", "inject": "optsdc@3:0",
                     "optimizer_check_samples": 0, "optimizer_check_every": 1}], tmp_path, stops=True)
    assert_rolled_back(cases["zero1"], cases["reference"], 1)
    assert_rolled_back(cases["zero3"], cases["reference"], 1)
    # an error of 1e-8 of the element passes unseen, below the limit the run states (8 units in the last place)
    assert not [line for line in cases["below-limit"] if line.startswith("health: step")]
    stated = next(line for line in cases["stderr"] if "optimizer updates checked every 1 steps" in line)
    assert 1e-8 < float(stated.split("an error under ")[1].split()[0]) < 1e-5
    assert max(losses(cases["no-checkpoints"])) == 2   # stopped at the step whose update was wrong, saying why
    assert "error: step 3: a wrong optimizer update, and no checkpoints to roll back to (--checkpoint-dir, " \
           "--save-every): training stopped" in cases["stderr"]


def test_a_wrong_optimizer_update_is_named_under_tensor_and_pipeline_parallelism(tmp_path):
    cases = run(4, [{"name": "reference", "layout": "tp=2,dp=2", "skip_steps": "3"},
                    *optimizer_cases(tmp_path, {"tp2-dp2": "tp=2,dp=2,zero=3", "pp2-dp2": "pp=2,dp=2,zero=3,mbs=1"},
                                     3)], tmp_path)
    assert_rolled_back(cases["tp2-dp2"], cases["reference"], 3)
    assert_rolled_back(cases["pp2-dp2"], cases["reference"], 3)


def test_every_checkpoint_follows_a_clean_check_and_a_rollback_returns_to_it(tmp_path):
    """Products checked only at the cadence (every 1,000 steps here) and on the step before each checkpoint
    (every 2): a wrong product at step 4, a save step, is found there; `--on-sdc rollback` returns to step 2's
    checkpoint and skips batch 4, and steps 5 and 6 are those of a run that skipped it. Each manifest records the
    check of its step. A wrong product at step 3, neither a save step nor due, passes unseen: the cadence's
    limit, which the goodput model prices (docs/reliability.md).

    `--on-sdc exclude` acts on the self-test: the injected error is in one product, not in the device, so the
    self-test passes and, never suspected before, the node is kept, recorded in suspected-nodes.json, and the
    job rolls back as under `rollback`. Found again (a record naming it from before), it is excluded though its
    self-test passes: on one node nothing is left to go on with, and the job stops saying so."""
    import socket
    saves = {"save_every": "2", "steps": 6, "gemm_every": 1000, "layout": "dp=2,zero=1"}
    node = f"node 0 ({socket.gethostname()})"
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "suspected-nodes.json").write_text(json.dumps([{"nodes": [node], "step": 1}]))
    cases = run(2, [{"name": "reference", "layout": "dp=2,zero=1", "skip_steps": "4", "steps": 6},
                    {"name": "rollback", **saves, "inject": "sdc@4:1", "on_sdc": "rollback",
                     "checkpoint_dir": str(tmp_path / "rollback")},
                    {"name": "unseen", **saves, "inject": "sdc@3:1", "checkpoint_dir": str(tmp_path / "unseen")},
                    {"name": "kept", **saves, "inject": "sdc@4:1", "on_sdc": "exclude",
                     "checkpoint_dir": str(tmp_path / "kept")},
                    {"name": "again", **saves, "inject": "sdc@4:1", "on_sdc": "exclude",
                     "checkpoint_dir": str(tmp_path / "again")}],
                tmp_path, stops=True)
    said = [line for line in cases["rollback"] if line.startswith("health: step")]
    assert said[0].startswith("health: step 4: a matrix product computed wrong (silent data corruption in "
                              "computation) on rank 1") and said[0].endswith("policy rollback"), said
    assert said[1] == "health: step 4: rolled back to step 2 (its checkpoint); batch 4 skipped", said
    expected = losses(cases["reference"])
    for name in ("rollback", "kept"):
        got = losses(cases[name])
        assert all(abs(got[step] - expected[step]) < LOSS_TOLERANCE for step in (5, 6)), (name, got, expected)
    manifest = json.loads((tmp_path / "rollback" / "step-000006" / "manifest.json").read_text())
    assert manifest["checks"]["products_checked_at_step"] is True
    assert not [line for line in cases["unseen"] if line.startswith("health: step")]
    assert "health: rank 1 on node 0 (" in "\n".join(cases["stderr"])
    assert f"health: step 4: a wrong matrix product on {node}: kept, its self-test passed and it was not suspected " \
           "before (a second finding excludes it); rolling back" in cases["stderr"]
    assert "health: step 4: rolled back to step 2 (its checkpoint); batch 4 skipped" in cases["kept"]
    suspected = json.loads((tmp_path / "kept" / "suspected-nodes.json").read_text())
    assert suspected[0]["nodes"] == [node] and suspected[0]["ranks"] == [1] and suspected[0]["step"] == 4
    assert any(line.startswith(f"health: step 4: a wrong matrix product on rank 1: {node} (found computing wrong "
                               "before (its self-test passes: a defect it does not reproduce)) excluded (policy "
                               "exclude); no node can go on") for line in cases["stderr"]), cases["stderr"][-20:]
    assert max(losses(cases["again"])) == 3


def test_a_node_is_excluded_where_its_self_test_fails_or_it_was_found_before():
    """Every combination of two suspected nodes' self-tests and earlier findings: excluded exactly where the
    self-test failed or the node was found before, each with its reason; kept otherwise."""
    import itertools

    from runtime.exclusion import decide
    for passed_a, passed_b, before_a, before_b in itertools.product((True, False), repeat=4):
        before = {node for node, was in (("a", before_a), ("b", before_b)) if was}
        decision = decide({"a": passed_a, "b": passed_b}, before)
        for node, passed, was in (("a", passed_a, before_a), ("b", passed_b, before_b)):
            assert (node in decision.excluded) == (not passed or was)
            assert (node in decision.kept) == (passed and not was)
            if not passed:
                assert decision.excluded[node] == "its self-test failed"


def test_the_runtime_takes_the_cadence_the_plans_goodput_model_chooses(tmp_path):
    """`--gemm-every auto` and `--optimizer-check-every auto` with a plan: the cadences of
    `planner.api.check_cadence` (the goodput model's for that plan's job), said and used on every rank; without a
    plan, refused in one line before step 1."""
    from planner import api
    path = tmp_path / "plan.yaml"
    plan = api.plan("tiny-llama", device="h100-sxm", num_devices=2, global_batch=8, stack="parallel-planner")
    plan.save(path)
    expected = api.check_cadence(plan)
    assert expected.products_every_steps > 0 and expected.optimizer_every_steps > 0
    proc = launch(2, "--model", "tiny-llama", "--plan", str(path), "--steps", "2", "--gemm-every", "auto",
                  "--optimizer-check-every", "auto", "--device-type", "cpu", "--precision", "fp32")
    assert f"note: matrix products checked every {expected.products_every_steps} steps, the cadence the plan's " \
           "goodput model chooses" in proc.stderr
    assert f"note: optimizer updates sampled every {expected.optimizer_every_steps} steps, the cadence the " \
           "plan's goodput model chooses" in proc.stderr
    refused = launch(1, "--model", "tiny-llama", "--steps", "2", "--gemm-every", "auto", check=False)
    assert refused.returncode == 2 and "--gemm-every auto needs a --plan" in refused.stderr
