"""The CLI end to end and its refusals (exit 2, one clear paragraph): commands run in this process through the
console script's own `cli.main` (an interpreter start-up per command would cost seconds each), and the
installed console script itself once."""
import contextlib
import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.layout import MEGATRON_ORDER
from cost_models.layout_codec import FIELDS
from hardware_profiles.loader import load_device
from planner import api, cli
from planner.plans import Plan
from planner.views import _default_text, _differences

PLANNER = str(Path(sys.executable).parent / "planner")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Megatron-LM argument names (megatron/training/arguments.py, Megatron-LM core_r0.13 and later)
MEGATRON_ARGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--seq-length", "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--fp8-format", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--tp-comm-overlap", "--grad-reduce-in-bf16", "--moe-flex-dispatcher-backend",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--fp8-recipe", "--pipeline-model-parallel-layout",
    "--moe-token-dispatcher-type", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--overlap-grad-reduce",
    "--overlap-param-gather",
    # TransformerConfig fields, which Megatron-LM's arguments.py turns into flags (ArgumentGroupFactory)
    "--recompute-modules", "--moe-grouped-gemm", "--cpu-offloading-num-layers",
}
# DeepSpeed config keys it reads (deepspeed/runtime/config.py, constants.py)
DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16",
                  "zero_optimization", "gradient_clipping", "activation_checkpointing", "communication_data_type"}


def run(args, check=True) -> subprocess.CompletedProcess:
    """`planner ARGS` as the console script runs it (`cli.main` with this argv), in this process: its exit
    status, standard output and standard error."""
    words = shlex.split(args)
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv, sys.argv = sys.argv, ["planner", *words]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = saved_argv
    proc = subprocess.CompletedProcess([PLANNER, *words], code, out.getvalue(), err.getvalue())
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_the_installed_console_script_runs_the_cli():
    proc = subprocess.run([PLANNER, "plan", "--help"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "--global-batch" in proc.stdout and "megatron-core" in proc.stdout
    refused = subprocess.run([PLANNER, "models", "show", "no-such-model"], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and refused.stderr.strip()


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    run(f"plan --model llama3-8b --device h100-sxm --num-devices 64 --global-batch 256 --fix tp=2,pp=2 --out {path}")
    return path


def test_plan_json_schema():
    proc = run("plan --model tiny-llama --device h100-sxm --num-devices 8 --global-batch 16 --json")
    data = json.loads(proc.stdout)
    for key in ("dp", "tp", "pp", "vp", "cp", "ep", "etp", "mbs", "gbs", "zero", "recompute", "schedule", "order"):
        assert key in data["layout"]
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "peak_memory_bytes",
                "peak_memory_bytes_per_stage", "fits", "breakdown", "search"):
        assert key in data
    assert {"wall_s", "cpu_s", "status", "candidates", "solved", "unexplored", "unproven_leaves", "gap"} <= set(data["search"])
    # the JSON's prediction is the API's for the layout it prints (another path through the code)
    layout = ",".join(f"{k}={data['layout'][k]}" for k in ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "mbs", "zero",
                                                            "recompute"))
    again = api.evaluate("tiny-llama", device="h100-sxm", num_devices=8, global_batch=16, layout=layout)
    assert data["step_time_s"] == pytest.approx(again.step_time_s, rel=1e-12)


def test_plan_table_and_goodput():
    proc = run("plan --model llama3-8b --device h100-sxm --num-devices 64 --global-batch 256 --objective goodput")
    assert "Step time breakdown" in proc.stdout and "ETTR" in proc.stdout and "Next best" in proc.stdout
    assert "recovery assumed: collective timeout 300 s, spare nodes kept" in proc.stdout   # said, not silent


def test_goodput_json_names_what_recovery_costs(capsys, monkeypatch):
    text = run_here("plan --model llama3-8b --device h100-sxm --num-devices 4096 --global-batch 4096 "
                    "--objective goodput --json --recovery spares=no,elastic=yes,timeout=1800", capsys, monkeypatch)
    good = json.loads(text)["goodput"]
    assert {"fewer nodes (crash)", "detection (hang)", "restart (crash)", "lost work"} <= set(good["lost_s_per_day"])
    assert "no spare nodes, continue on the nodes left" in good["notes"][0]
    assert good["ettr"] * 86400 + sum(good["lost_s_per_day"].values()) == pytest.approx(86400, rel=1e-9)


def test_next_best_layouts_are_the_layouts_their_step_times_are_for():
    """An alternative's layout text, given back to `evaluate`, is predicted at the step time the table shows and
    fits: its recomputation is the one the search chose per block (here every block, as megatron-lm-2021 recomputes
    every layer or none), not the `recompute` field's default, which alone would say none and not fit."""
    job = dict(device="a100-80g", num_devices=64, global_batch=512, stack="megatron-lm-2021", time_limit_s=60)
    result = api.plan("gpt3-175b", **job)
    assert result.alternatives and result.layout.recompute == "full"
    for alternative in result.alternatives:
        assert "recompute=full" in alternative.layout.split(",")
        assert "recompute" not in _differences(alternative.layout, result)   # the plan recomputes so too
        given = api.evaluate("gpt3-175b", layout=alternative.layout, **job)
        assert given.fits and given.step_time_s == pytest.approx(alternative.step_time_s, rel=1e-9)


def test_next_best_names_what_differs_from_the_plan():
    result = api.plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, tp=2, pp=2)
    best = result.layout
    assert result.alternatives
    for alternative in result.alternatives:
        shown = dict(item.split("=") for item in _differences(alternative.layout, result).split(", "))
        full = dict(item.split("=") for item in alternative.layout.split(","))
        # a key the alternative's text leaves out is at its default there (`text_of`)
        assert shown and all(full.get(key, _default_text(key)) == value for key, value in shown.items())
        same = {key: value for key, value in full.items() if key not in shown}
        assert same.pop("order", "-".join(best.mesh_order)) == "-".join(best.mesh_order)
        values = best.layout_values()   # by the keys the text uses, written as the text writes them
        assert all(FIELDS[key].field.domain.text(values[key]) == value for key, value in same.items())
        given = api.evaluate("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256,
                             layout=alternative.layout)   # what the table shows is valid --layout input
        assert "-".join(given.layout.mesh_order) == full.get("order", "-".join(MEGATRON_ORDER))
        tie = f"{alternative.step_time_s:.6g}" == f"{result.step_time_s:.6g}"
        assert alternative.loses.startswith("ties" if tie else f"{alternative.step_time_s / result.step_time_s - 1:.1%}")


def test_evaluate_given_layout_and_partial_layout(capsys, monkeypatch):
    data = json.loads(run_here("evaluate --model llama3-8b --device h100-sxm --num-devices 64 --global-batch 256 "
                               "--json --layout tp=2,pp=2,dp=16,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=selective",
                               capsys, monkeypatch))
    assert data["layout"]["tp"] == 2 and data["layout"]["dp"] == 16 and data["search"] is None
    partial = json.loads(run_here("evaluate --model llama3-8b --device h100-sxm --num-devices 64 --global-batch 256 "
                                  "--json --layout tp=4", capsys, monkeypatch))
    assert partial["layout"]["tp"] == 4 and partial["search"]["candidates"] > 0


def run_here(args, capsys, monkeypatch) -> str:
    """The CLI in this process (no interpreter start-up): its standard output."""
    monkeypatch.setattr(sys, "argv", ["planner", *shlex.split(args)])
    capsys.readouterr()
    try:
        cli.main()
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    return capsys.readouterr().out


def test_precision_pinned_in_the_layout_text_is_the_plan_precision(capsys, monkeypatch):
    for args in ("plan --fix tp=1,precision=fp8", "plan --fix precision=fp8,gbs=16 --precision fp8",
                 "evaluate --layout tp=1,precision=fp8"):
        command, rest = args.split(" ", 1)
        data = json.loads(run_here(f"{command} --model tiny-llama --device h100-sxm --num-devices 8 "
                                   f"--global-batch 16 --json {rest}", capsys, monkeypatch))
        assert data["layout"]["precision"] == "fp8"


def test_fp8_recipe_is_predicted_recorded_and_exported(tmp_path, capsys, monkeypatch):
    """Current (tensorwise) scaling reads every cast tensor once more for its amax: slower than delayed
    scaling, recorded in the plan, exported as Megatron's --fp8-recipe, and refused on anything else."""
    args = ("evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --json "
            "--layout tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none,precision=fp8")
    delayed = json.loads(run_here(args, capsys, monkeypatch))
    current = json.loads(run_here(args + ",fp8_recipe=tensorwise", capsys, monkeypatch))
    assert delayed["layout"]["fp8_recipe"] == "delayed" and current["layout"]["fp8_recipe"] == "tensorwise"
    assert current["breakdown"]["compute_s"] > delayed["breakdown"]["compute_s"]
    path = tmp_path / "plan.yaml"
    run_here(f"plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --precision fp8 "
             f"--fix fp8_recipe=tensorwise --out {path}", capsys, monkeypatch)
    exported = run(f"export {path} --to megatron").stdout
    assert "--fp8-recipe tensorwise" in exported
    assert {token for token in exported.split() if token.startswith("--")} <= MEGATRON_ARGS


def exposed_chunked_ring(comm_s: float, compute_s: float, steps: int) -> float:
    """Timeline of a collective cut into `steps` ring steps beside the GEMM cut the same way: the link
    sends the chunks back to back, chunk k's GEMM starts once its data arrived and the GEMM before ended.
    Exposed = end of the last GEMM - the GEMM time."""
    sent = done = 0.0
    for _ in range(steps):
        sent += comm_s / steps
        done = max(done, sent) + compute_s / steps
    return done - compute_s


def exposed_combined_1f1b(a2a_s: float, compute_s: float, micro_batches: int, held_share: float) -> float:
    """Timeline of Megatron's combined 1F1B without a pipeline: F1, then slots (F(i+1) beside B(i)), then the
    last B. In a slot each pass's all-to-alls run while the other pass computes (backward = 2 x forward) on the
    SMs the all-to-all leaves (it holds `held_share` of them): what the other pass's compute cannot cover
    stays exposed, the compute it slows at least, and the two unpaired passes expose theirs."""
    forward, backward = compute_s / micro_batches / 3, 2 * compute_s / micro_batches / 3
    a2a_forward = a2a_backward = a2a_s / micro_batches / 2
    slots = micro_batches - 1
    paired = max(a2a_forward - backward, a2a_forward * held_share) + \
        max(a2a_backward - forward, a2a_backward * held_share)
    return a2a_forward + slots * paired + a2a_backward


def test_moe_a2a_overlap_hides_all_but_the_unpaired_passes(tmp_path, capsys, monkeypatch):
    """Combined 1F1B pairs the forward of micro-batch i+1 with the backward of i: where compute outlasts
    the all-to-alls, only the first forward's and the last backward's stay exposed, 1/m of them (m = 4
    micro-batches here); with a pipeline but no virtual stages Megatron cannot pair, nothing changes."""
    args = ("evaluate --model mixtral-8x7b --device h100-sxm --num-devices 16 --global-batch 64 --json "
            "--layout tp=1,pp={pp},dp={dp},cp=1,ep=8,etp=1,vp=1,mbs=1,zero=1,dispatcher=alltoall,recompute={rc}")

    def evaluate(pp, dp, flag="", rc="selective"):
        return json.loads(run_here(args.format(pp=pp, dp=dp, rc=rc) + flag, capsys, monkeypatch))

    plain, overlapped = evaluate(1, 16, rc="selective,a2a_overlap=false"), evaluate(1, 16, " --moe-a2a-overlap")
    assert plain["breakdown"]["ep_comm_s"] > 0 and overlapped["layout"]["moe_a2a_overlap"] is True
    # Megatron-Core can run it (off by default): a whole layout that leaves it out takes the faster of the two
    assert evaluate(1, 16) == overlapped and overlapped["step_time_s"] < plain["step_time_s"]
    # without a pipeline the next micro-batch's forward runs beside this one's backward: two held, not one
    # (Megatron-Core combined_1f1b_schedule_for_no_pipelining)
    assert overlapped["memory"][0]["parts"]["activations"] == pytest.approx(
        2 * plain["memory"][0]["parts"]["activations"], rel=1e-9)
    assert evaluate(1, 16, " --moe-a2a-overlap", rc="selective,a2a_overlap=false")["breakdown"] == plain["breakdown"]
    micro_batches = 64 // 16
    h100 = load_device("h100-sxm")   # NCCL's all-to-all in one node holds one SM per p2p channel
    held = h100.nccl_p2p_sms.within_node / h100.sm_count
    assert overlapped["breakdown"]["ep_comm_s"] == pytest.approx(
        exposed_combined_1f1b(plain["breakdown"]["ep_comm_s"], plain["breakdown"]["compute_s"], micro_batches,
                              held), rel=1e-6)
    piped = evaluate(2, 8, " --moe-a2a-overlap")
    assert piped["layout"]["moe_a2a_overlap"] is False
    assert piped["breakdown"]["ep_comm_s"] == evaluate(2, 8)["breakdown"]["ep_comm_s"]
    # Megatron-Core refuses the overlap beside full recomputation: predicted without it
    full = evaluate(1, 16, " --moe-a2a-overlap", rc="full")
    assert full["layout"]["moe_a2a_overlap"] is False
    assert full["breakdown"]["ep_comm_s"] == evaluate(1, 16, rc="full")["breakdown"]["ep_comm_s"]
    path = tmp_path / "plan.yaml"
    run_here(f"plan --model mixtral-8x7b --device h100-sxm --num-devices 16 --global-batch 64 "
             f"--fix pp=1,ep=8,a2a_overlap=true --moe-a2a-overlap --out {path}", capsys, monkeypatch)
    assert all(r != "full" for stage in Plan.load(path).stages for r in stage.recompute)   # the search keeps the pair
    exported = run(f"export {path} --to megatron").stdout
    assert "--overlap-moe-expert-parallel-comm" in exported and "--delay-wgrad-compute" in exported
    assert {token for token in exported.split() if token.startswith("--")} <= MEGATRON_ARGS


def test_tp_comm_overlap_leaves_one_chunk_exposed(tmp_path, capsys, monkeypatch):
    """With TP overlap the collectives run as tp ring steps beside the GEMMs: where the layer's compute
    is longer than the communication, one step of tp is left exposed. Megatron-Core's stack runs it (the search
    takes it, `tp_overlap=false` pins it off); `--tp-comm-overlap` adds it to a stack without it (NeMo 2's)."""
    args = ("evaluate --model llama3-70b --device h100-sxm --num-devices 64 --global-batch 64 --json "
            "--layout tp=8,pp=8,dp=1,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=full")
    plain = json.loads(run_here(args + ",tp_overlap=false", capsys, monkeypatch))
    overlapped = json.loads(run_here(args, capsys, monkeypatch))
    assert plain["breakdown"]["tp_comm_s"] > 0 and overlapped["layout"]["tp_comm_overlap"] is True
    assert overlapped["breakdown"]["tp_comm_s"] == pytest.approx(
        exposed_chunked_ring(plain["breakdown"]["tp_comm_s"], plain["breakdown"]["compute_s"], steps=8), rel=1e-6)
    nemo = json.loads(run_here(args + " --stack nemo-2", capsys, monkeypatch))
    flagged = json.loads(run_here(args + " --stack nemo-2 --tp-comm-overlap", capsys, monkeypatch))
    assert not nemo["layout"]["tp_comm_overlap"] and flagged["layout"]["tp_comm_overlap"]
    path = tmp_path / "plan.yaml"
    run_here(f"plan --model llama3-70b --device h100-sxm --num-devices 64 --global-batch 64 --fix tp=8,pp=8 "
             f"--out {path}", capsys, monkeypatch)
    assert "--tp-comm-overlap" in run(f"export {path} --to megatron").stdout


def test_evaluate_explains_a_layout_that_does_not_fit(capsys, monkeypatch):
    data = json.loads(run_here("evaluate --model llama3-70b --device h100-sxm --num-devices 8 --global-batch 8 "
                               "--json --layout tp=8,pp=1,dp=1,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none",
                               capsys, monkeypatch))
    assert data["fits"] is False and data["reasons"][0].startswith("does not fit")


def test_megatron_export(plan_file):
    proc = run(f"export {plan_file} --to megatron")
    names = {token for token in proc.stdout.split() if token.startswith("--")}
    assert names <= MEGATRON_ARGS
    plan = Plan.load(plan_file)
    assert f"--tensor-model-parallel-size {plan.layout.tp}" in proc.stdout
    assert f"--pipeline-model-parallel-size {plan.layout.pp}" in proc.stdout
    assert f"--global-batch-size {plan.layout.gbs}" in proc.stdout


def test_torchtitan_export(plan_file):
    """The command line torchtitan 0.3 takes (tests/test_exports_torchtitan.py reads it with torchtitan's
    own parser); another release is refused, naming the one checked."""
    proc = run(f"export {plan_file} --to torchtitan@0.3")
    plan = Plan.load(plan_file)
    # the plan's model is torchtitan's llama3_8b (tests/test_exports_torchtitan_registry.py runs such commands)
    assert proc.stdout.startswith("python -m torchtitan.train \\\n  --module llama3 --config llama3_8b")
    assert f"--parallelism.tensor_parallel_degree {plan.layout.tp}" in proc.stdout
    assert f"--parallelism.pipeline_parallel_degree {plan.layout.pp}" in proc.stdout
    assert "note: written for torchtitan 0.3" in proc.stderr
    refused = run(f"export {plan_file} --to torchtitan@0.2", check=False)
    assert refused.returncode == 2 and "torchtitan@0.3" in refused.stderr


def test_deepspeed_export(plan_file):
    data = json.loads(run(f"export {plan_file} --to deepspeed").stdout)
    plan = Plan.load(plan_file)
    assert set(data) <= DEEPSPEED_KEYS
    assert data["train_batch_size"] == plan.layout.gbs
    assert data["train_micro_batch_size_per_gpu"] * data["gradient_accumulation_steps"] * plan.layout.dp == plan.layout.gbs
    assert data["zero_optimization"]["stage"] == plan.layout.zero


def test_torchrun_export(plan_file):
    line = run(f"export {plan_file} --to torchrun").stdout
    assert line.startswith("torchrun ") and "--plan" in line and "--nproc-per-node 8" in line


def test_profiles_and_models(capsys, monkeypatch):
    assert "h100-sxm" in run("profiles list").stdout   # one run through the installed entry point
    assert "nic_bandwidth_gbit_per_s" in run_here("profiles show dgx-h100", capsys, monkeypatch)
    assert "deepseek-v3" in run_here("models list", capsys, monkeypatch)
    data = json.loads(run_here("models show mixtral-8x7b --json", capsys, monkeypatch))
    assert data["total_params"] == pytest.approx(46.7e9, rel=0.005)
    assert data["layers_by_kind"]["moe"] == 32 and data["flops_per_token"] > 0


def test_whatif_writes_plot_and_html(tmp_path):
    proc = run(f"whatif --model llama3-8b --device h100-sxm --sweep num-devices=16,32 --global-batch 64 "
               f"--tokens 1T --out {tmp_path}")
    assert "What-if" in proc.stdout
    png, html = tmp_path / "whatif.png", tmp_path / "whatif.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = html.read_text()
    assert "<table>" in page and "data:image/png;base64," in page and "http" not in page.split("<body>")[1]


BAD = [
    "plan --model gpt-9000 --device h100-sxm --num-devices 8 --global-batch 8",
    "plan --model llama3-8b --device h100-sxm --num-devices 0 --global-batch 8",
    "plan --model llama3-8b --device h100-sxm --num-devices 12 --global-batch 8",
    "plan --model llama3-8b --device h1000 --num-devices 8 --global-batch 8",
    "plan --model llama3-8b --cluster nowhere-cluster --global-batch 8",
    "plan --model llama3-8b --cluster /no/such/cluster.yaml --global-batch 8",
    "plan --model llama3-8b --global-batch 8",
    "plan --model llama3-8b --device h100-sxm --global-batch 8",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 0",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch -4",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix tp",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix tq=2",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix tp=two",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix zero=5",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix recompute=sometimes",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --precision fp4",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --objective speed",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix precision=fp8 --precision bf16",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix gbs=16",
    "plan --model llama3-8b --device a100-80g --num-devices 8 --global-batch 8 --precision fp8",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=1,precision=fp4",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --precision fp8 --fix fp8_recipe=mx",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix order=tp-pp-cp",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --fix order=tp-tp-cp-ep-dp",
    "evaluate --model llama3-8b --device a100-80g --num-devices 8 --global-batch 8 --layout tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none,precision=fp8",
    "plan --model llama3-405b --device h100-sxm --num-devices 8 --global-batch 8 --time-limit 20",
    "plan --model /no/such/config.json --device h100-sxm --num-devices 8 --global-batch 8",
    "plan --model /no/such/model.yaml --device h100-sxm --num-devices 8 --global-batch 8",
    "plan --model examples/user_gpt.py --device h100-sxm --num-devices 8 --global-batch 8",
    "plan --model examples/user_gpt.py:nothing --device h100-sxm --num-devices 8 --global-batch 8 --seq-len 64",
    "plan --model examples/user_gpt.py:build --device h100-sxm --num-devices 8 --global-batch 8",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --seq-len 0",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=3,pp=1,dp=1,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=2,pp=2,dp=4,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 6 --layout tp=1,pp=1,dp=8,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=8,pp=1,dp=1,cp=1,ep=2,etp=1,vp=1,mbs=1,zero=1,recompute=none",
    "evaluate --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=8;pp=1",
    "whatif --model llama3-8b --device h100-sxm --sweep num-devices --global-batch 8",
    "whatif --model llama3-8b --device h100-sxm --sweep nodes=1,2 --global-batch 8",
    "whatif --model llama3-8b --device h100-sxm --sweep num-devices=8,x --global-batch 8",
    "whatif --model llama3-8b --device h100-sxm --sweep num-devices=8 --global-batch 8 --tokens lots",
    "whatif --model llama3-8b --sweep device=h100-sxm,h1000 --num-devices 8 --global-batch 8",
    "export /no/such/plan.yaml --to megatron",
    "export README.md --to megatron",
    "profiles show no-such-profile",
    "models show no-such-model",
    "plan --model llama3-8b --device h100-sxm --num-devices 8 --global-batch 8 --no-such-flag",
    "plan --model tiny-moe --device h100-sxm --num-devices 8 --global-batch 8 --ep-imbalance 0.8",
    "evaluate --model tiny-moe --device h100-sxm --num-devices 8 --global-batch 8 --layout tp=1 --ep-imbalance nan",
]


@pytest.mark.parametrize("args", BAD)
def test_bad_invocations_exit_2_with_one_paragraph(args, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "argv", ["planner", *shlex.split(args)])
    with pytest.raises(SystemExit) as info:
        cli.main()
    captured = capsys.readouterr()
    assert info.value.code == 2, captured.err
    assert "Traceback" not in captured.err and captured.err.strip()


def test_export_to_unknown_target(plan_file, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["planner", "export", str(plan_file), "--to", "jax"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2 and "megatron" in capsys.readouterr().err


def test_evaluate_json_and_out_load_as_plans(tmp_path, capsys, monkeypatch):
    """`evaluate --json` printed keys Plan.load refused; it is a plan file now, as is `evaluate --out`."""
    args = ("evaluate --model tiny-llama --device h100-sxm --num-devices 8 --global-batch 16 "
            "--layout tp=2,pp=2,dp=2,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none")
    printed = tmp_path / "printed.json"
    printed.write_text(run_here(args + " --json", capsys, monkeypatch))
    written = tmp_path / "written.yaml"
    run_here(args + f" --out {written}", capsys, monkeypatch)
    assert Plan.load(printed).model_dump() == Plan.load(written).model_dump()
    assert Plan.load(printed).layout.tp == 2


def test_the_deepep_dispatcher_is_an_input_recorded_and_exported(tmp_path, capsys, monkeypatch):
    """`--moe-dispatcher deepep` (the only dispatcher the stack runs): experts spread over 4 nodes send one copy
    per node instead of one per expert (the exposed all-to-all shrinks), the plan says which dispatcher it
    billed, the Megatron export asks for the flex dispatcher's DeepEP backend; left out, evaluate weighs the
    stack's three and takes the fastest, here DeepEP's; an unknown dispatcher exits 2 naming the flag."""
    args = ("evaluate --model mixtral-8x7b --device h100-sxm --num-devices 32 --devices-per-node 4 --global-batch 64 "
            "--json --layout tp=1,pp=1,dp=32,cp=1,ep=8,etp=1,vp=1,mbs=1,zero=1,recompute=none")
    plain = json.loads(run_here(args.replace("recompute=none", "recompute=none,dispatcher=alltoall"), capsys,
                                monkeypatch))
    chosen = json.loads(run_here(args, capsys, monkeypatch))
    assert chosen["layout"]["moe_dispatcher"] == "deepep"
    path = tmp_path / "plan.yaml"
    run_here(args.replace("--json", f"--out {path}") + " --moe-dispatcher deepep", capsys, monkeypatch)
    deepep = Plan.load(path)
    assert deepep.layout.moe_dispatcher == "deepep" and plain["layout"]["moe_dispatcher"] == "alltoall"
    assert 0 < deepep.breakdown["ep_comm_s"] < plain["breakdown"]["ep_comm_s"]
    exported = run(f"export {path} --to megatron").stdout
    assert "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep" in exported
    assert {token for token in exported.split() if token.startswith("--")} <= MEGATRON_ARGS
    proc = run(args + " --moe-dispatcher nccl", check=False)
    assert proc.returncode == 2 and "--moe-dispatcher" in proc.stderr and "Traceback" not in proc.stderr
