"""Health checks inside the step (runtime/health.py), each fault injected on CPU/gloo (runtime/faults.py):
detected at the step it happens, named in one line that starts with `health:`, and the policy applied on
every rank; a skipped batch leaves the run where a run that never trained on it would be."""
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_runtime import LOSS_TOLERANCE, TRAIN, launch, losses

pytestmark = pytest.mark.timed


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs the faulty ones are compared with, in one launch: the uninterrupted run, and
    runs that never trained on the batches a policy skips."""
    spec = tmp_path_factory.mktemp("references") / "cases.json"
    cases = [{"name": "plain", "steps": 6}, {"name": "skip2", "steps": 4, "skip_steps": "2"},
             {"name": "skip10", "steps": 12, "skip_steps": "10"}, {"name": "skip9-10", "steps": 13, "skip_steps": "9,10"}]
    spec.write_text(json.dumps([{**case, "model": "tiny-llama"} for case in cases]))
    proc = launch(1, "--cases", str(spec), *TRAIN)
    runs = {case["name"]: {} for case in cases}
    for line in proc.stdout.splitlines():
        if line.startswith("case ") and " step " in line:
            _, name, _, step, _, loss = line.split()
            runs[name][int(step)] = float(loss)
    return {name: [steps[s] for s in sorted(steps)] for name, steps in runs.items()} | {"by step": runs}


def health_lines(proc) -> list[str]:
    """Distinct health lines; ranks write concurrently, so one output line may hold two ranks' messages."""
    text = (proc.stdout + proc.stderr).replace("health: ", "\nhealth: ")
    return sorted({line for line in text.splitlines() if line.startswith("health:")})


@dataclass(frozen=True)
class CaseRun:
    """One case of a multi-case launch: rank 0's stdout lines from its `begin case` marker to the next."""
    stdout: str
    stderr: str = ""


def run_faults(nproc: int, cases: list[dict], directory: Path) -> dict[str, CaseRun]:
    """Several faulty runs in one launch (starting ranks costs seconds; a case, a fraction), split by case.
    The launch's stderr goes with the last case (a policy that stops the job ends the launch there)."""
    spec = directory / "cases.json"
    spec.write_text(json.dumps([{"model": "tiny-llama", **case} for case in cases]))
    proc = launch(nproc, "--cases", str(spec), *TRAIN, check=False)
    lines: dict[str, list[str]] = {}
    current = None
    for line in proc.stdout.replace("health: ", "\nhealth: ").splitlines():
        if line.startswith("begin case "):
            current = line.split()[2]
            lines[current] = []
        elif current is not None:
            lines[current].append(line.removeprefix(f"case {current} "))
    runs = {name: CaseRun("\n".join(text) + "\n") for name, text in lines.items()}
    runs[cases[-1]["name"]] = CaseRun(runs[cases[-1]["name"]].stdout, proc.stderr) if cases[-1]["name"] in runs \
        else CaseRun("", proc.stderr)
    return runs | {"returncode": proc.returncode}


@pytest.fixture(scope="module")
def dp2_faults(tmp_path_factory):
    """dp=2: a NaN skipped, a spike rolled back, and last a NaN that stops the job (it ends the launch)."""
    directory = tmp_path_factory.mktemp("dp2")
    return run_faults(2, [
        {"name": "nan-skip", "layout": "dp=2", "steps": 4, "inject": "nan@2:1"},
        {"name": "rollback", "layout": "dp=2", "steps": 13, "inject": "spike@10", "on_spike": "rollback",
         "rollback_skip": 2, "checkpoint_dir": str(directory / "ckpt"), "save_every": "4", "async_save": True},
        {"name": "nan-stop", "layout": "dp=2", "steps": 4, "inject": "nan@2:0", "on_nonfinite": "stop"}],
        directory) | {"checkpoints": directory / "ckpt"}


def test_a_nan_gradient_is_named_and_its_batch_skipped_on_every_rank(references, dp2_faults):
    faulty = dp2_faults["nan-skip"]
    assert health_lines(faulty) == ["health: step 2: non-finite loss or gradients on rank 1; policy skip"]
    assert losses(faulty)[2:] == pytest.approx(references["skip2"][1:], rel=LOSS_TOLERANCE)


def test_a_nan_gradient_stops_the_job_when_the_policy_says_stop(dp2_faults):
    proc = dp2_faults["nan-stop"]
    assert dp2_faults["returncode"] != 0
    assert "health: step 2: non-finite loss or gradients on rank 0; policy stop" in proc.stdout
    assert proc.stderr.count("stopped by the health policy") == 2   # every rank, at the same step


def test_a_loss_spike_is_named_and_skipped(references):
    faulty = launch(1, "--model", "tiny-llama", "--steps", "12", *TRAIN, "--inject", "spike@10")
    lines = health_lines(faulty)
    assert len(lines) == 1 and lines[0].startswith("health: step 10: loss spike") and "policy skip" in lines[0]
    skipped = references["skip10"]
    assert losses(faulty)[:9] == pytest.approx(skipped[:9], rel=LOSS_TOLERANCE)   # no false alarm before
    assert losses(faulty)[10:] == pytest.approx(skipped[9:], rel=LOSS_TOLERANCE)


def last_losses(proc) -> dict[int, float]:
    """Each step's loss as finally trained (a rollback trains some steps twice: the later line counts)."""
    return {int(line.split()[1]): float(line.split()[-1]) for line in proc.stdout.splitlines()
            if line.startswith("step ")}


def test_a_loss_spike_rolls_back_to_the_last_checkpoint_and_skips_its_batches(references, dp2_faults):
    """dp=2, checkpoints every 4 steps written asynchronously; the spike at step 10 rolls back to step 8,
    skips batches 9 and 10, retrains none of them: the run ends where a run that never saw them does."""
    faulty = dp2_faults["rollback"]
    lines = health_lines(faulty)
    assert lines[0].startswith("health: step 10: loss spike") and "policy rollback" in lines[0]
    assert lines[1] == "health: step 10: rolled back to step 8 (its checkpoint); batches 9, 10 skipped"
    trained, reference = last_losses(faulty), references["by step"]["skip9-10"]
    assert sorted(trained) == [*range(1, 10), 11, 12, 13]   # 9 was trained once, then rolled back
    assert sorted(reference) == [*range(1, 9), 11, 12, 13]
    assert [trained[s] for s in reference] == pytest.approx(list(reference.values()), rel=LOSS_TOLERANCE)
    assert (dp2_faults["checkpoints"] / "latest").read_text() == "step-000012"


def test_a_rollback_without_checkpoints_is_refused_before_step_one():
    proc = launch(1, "--model", "tiny-llama", "--steps", "2", "--on-spike", "rollback", check=False)
    assert proc.returncode == 2 and "needs checkpoints to roll back to" in proc.stderr and "step 1" not in proc.stdout


@pytest.fixture(scope="module")
def dp4_faults(tmp_path_factory):
    """dp=4, ZeRO-0: a flipped bit before a checkpoint, a straggler, a flipped bit at a check."""
    directory = tmp_path_factory.mktemp("dp4")
    common = {"layout": "dp=4,zero=0"}
    return run_faults(4, [
        {"name": "disagree", **common, "steps": 4, "inject": "bitflip@3:1", "sdc_every": 100,
         "checkpoint_dir": str(directory / "ckpt"), "save_every": "2"},
        {"name": "straggler", **common, "steps": 10, "inject": "slow@7:2", "straggler_every": 5, "sdc_every": 1},
        {"name": "bitflip", **common, "steps": 4, "inject": "bitflip@3:1", "sdc_every": 1}],
        directory) | {"checkpoints": directory / "ckpt"}


def test_no_checkpoint_is_written_while_replicas_disagree(dp4_faults):
    """A flipped bit after step 3 with no periodic check due: the check before step 4's save finds it, and
    the clean checkpoint of step 2 stays the one a restart would load."""
    lines = health_lines(dp4_faults["disagree"])
    assert lines[0].startswith("health: step 4: no checkpoint written while replicas disagree")
    assert lines[1].startswith("health: step 4: parameters of rank 1 differ from their data-parallel replicas")
    assert (dp4_faults["checkpoints"] / "latest").read_text() == "step-000002"


def test_checkpoints_follow_dalys_interval_from_the_measured_blocking(tmp_path):
    """--save-every auto: the first save measures its blocking time; the next is due after Daly's interval
    for it and the job's MTBF (Daly 2006: sqrt(2 d M) [1 + sqrt(d/2M)/3 + d/(18M)] - d), in steps of the
    measured step time."""
    import re
    mtbf = 3.0
    proc = launch(1, "--model", "tiny-llama", "--steps", "40", *TRAIN, "--checkpoint-dir", str(tmp_path / "ckpt"),
                  "--save-every", "auto", "--mtbf-s", str(mtbf))
    pattern = re.compile(r"checkpoint: step (\d+) blocked ([\d.]+) s; next every (\d+) steps \(Daly: MTBF [\d.]+ s, "
                         r"step ([\d.]+) s")
    found = [pattern.search(line) for line in proc.stderr.splitlines() if line.startswith("checkpoint:")]
    assert found and all(found)
    saved = sorted(int(path.name.split("-")[1]) for path in (tmp_path / "ckpt").glob("step-*"))
    assert [int(match.group(1)) for match in found] == saved and saved[0] == 1
    for match, following in zip(found, saved[1:]):
        step, blocking, every, step_s = int(match.group(1)), float(match.group(2)), int(match.group(3)), \
            float(match.group(4))
        interval = (2 * blocking * mtbf) ** 0.5 * (1 + (blocking / (2 * mtbf)) ** 0.5 / 3 + blocking / (18 * mtbf)) \
            - blocking
        assert abs(every - interval / step_s) <= 0.5 + 1e-3 * every   # whole steps, from the printed figures
        assert following == step + every


def test_a_slow_rank_is_named_a_straggler_and_a_clean_run_raises_nothing_else(dp4_faults):
    """Rank 2 computes 0.2 s slower per forward from step 7 on; its peers wait for it inside the collectives,
    so only per-rank compute time tells: the check at step 10 names it, the one at step 5 (before the fault)
    names no one. The same run fingerprints its 4 replicas every step: no corruption is reported where
    there is none."""
    lines = health_lines(dp4_faults["straggler"])
    assert len(lines) == 1 and lines[0].startswith("health: step 10: straggler: rank 2 ")
    assert lines[0].endswith("over ranks 0, 1, 2, 3")


def test_a_flipped_bit_in_one_replica_names_the_rank(dp4_faults):
    lines = health_lines(dp4_faults["bitflip"])
    assert lines[0] == ("health: step 3: parameters of rank 1 differ from their data-parallel replicas (silent "
                        "data corruption); ranks 0, 1, 2, 3 compared")
    assert dp4_faults["returncode"] == 0
    # a clean run raising no line: the straggler case, which fingerprints every step


# stop@5:1: the live rank kills the stopped one on its node (state T), so torchrun restarts at once instead of
# after its 30 s grace for a worker that cannot take its SIGTERM (the restart path ignores the shutdown timeout)
@pytest.mark.parametrize("fault", ["kill@5:1", "stop@5:1"])
def test_a_dead_rank_ends_in_a_restart_that_resumes_the_run(fault, tmp_path, references):
    """torchrun --max-restarts 1: rank 1 dies (SIGKILL) or stops (SIGSTOP) before step 5; the live rank names
    it (the watchdog), torchrun restarts the job, which resumes from the last complete checkpoint (step 4) and
    trains steps 5 and 6 as the uninterrupted run does; nothing is trained twice."""
    import socket

    from test_runtime import DRIVER, ENV, ROOT
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *DRIVER,
               "--model", "tiny-llama", "--steps", "6", *TRAIN, "--layout", "dp=2", "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--save-every", "2", "--inject", fault, "--collective-timeout", "5"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000004 (restart 1)" in proc.stderr
    assert any(line.startswith("health:") and "rank 1 did not reach step 5" in line
               for line in proc.stderr.splitlines())
    if fault.startswith("stop"):   # killed by its peer on this node, not left to torchrun's 30 s grace
        assert "rank 1 stopped (SIGSTOP) on this node: killed" in proc.stderr
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert losses(proc) == pytest.approx(references["plain"], rel=LOSS_TOLERANCE)


def test_the_launchers_sigterm_names_the_rank_that_stopped():
    """torchrun ends the live ranks with SIGTERM when a worker dies, usually before their collective has
    failed: rank 1 stops itself before step 2 (the collective timeout is far away, 120 s) and the launcher is
    told to end the job; rank 0, blocked in step 2's collective, still names rank 1 within seconds."""
    import selectors
    import time

    from test_runtime import DRIVER, ENV, ROOT, end_launch, free_port
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *DRIVER, "--model", "tiny-llama", "--steps", "4", "--layout",
               "dp=2", "--collective-timeout", "120", "--inject", "stop@2:1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True)
    watch = selectors.DefaultSelector()
    watch.register(proc.stdout, selectors.EVENT_READ, "out")
    watch.register(proc.stderr, selectors.EVENT_READ, "err")
    health, terminated_at, started = None, None, time.time()
    try:
        while health is None and time.time() - started < 120:
            for key, _ in watch.select(timeout=1):
                line = key.fileobj.readline()
                if key.data == "out" and line.startswith("step 1 ") and terminated_at is None:
                    time.sleep(1.0)   # rank 0 is now inside step 2, waiting for rank 1
                    terminated_at = time.time()
                    proc.send_signal(signal.SIGTERM)   # the agent passes it on to its workers
                elif key.data == "err" and line.startswith("health:"):
                    health = line
    finally:   # the stopped rank cannot end by itself
        end_launch(proc)
    assert health is not None and terminated_at is not None, "no health: line within 120 s"
    assert "terminated by the launcher (SIGTERM) at step 2" in health
    assert "rank 1 did not reach step 2 (stopped or dead)" in health
    assert time.time() - terminated_at < 20   # not the 120 s timeout, nor torchrun's 30 s grace


def named_behind(line: str) -> set[int]:
    """The ranks a health line says did not reach a step ('rank 2 did not...', 'ranks 2, 3 did not...')."""
    words = line.split(" did not reach step")[0].rsplit("; ", 1)[-1]
    return {int(word) for word in words.replace("ranks ", "").replace("rank ", "").split(", ")}


def agent(port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One torchrun agent: a node of 2 ranks in a c10d rendezvous of 1 to 2 nodes on `port`."""
    from test_runtime import DRIVER, ENV, ROOT
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "lost-node", "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3",
               *DRIVER, *args]
    return subprocess.Popen(command, stdout=log.with_suffix(".out").open("w"), stderr=log.with_suffix(".err").open("w"),
                            env=ENV, cwd=ROOT, start_new_session=True)


def two_nodes(port: int, args: list[str], tmp_path: Path) -> subprocess.Popen:
    """Two agents of `args` (logs node0.*, node1.*): the first hosts the rendezvous store and must end with 0;
    the second (ranks 2 and 3: the later agent, the larger pid) is returned once both have ended."""
    import socket
    import time
    first = agent(port, args, tmp_path / "node0")
    deadline = time.time() + 60
    while time.time() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    second = agent(port, args, tmp_path / "node1")
    try:
        assert first.wait(timeout=240) == 0, (tmp_path / "node0.err").read_text()[-3000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return second


def test_a_lost_node_is_replanned_and_the_run_continues(tmp_path, references):
    """Two torchrun agents on this machine are two nodes of 2 CPUs, training a 4-device plan. Before step 4
    rank 2's node is lost (its agent and both its workers SIGKILLed). The agent left restarts its workers
    (--max-restarts 1), the rendezvous closes with the one node, and --elastic plans the same global batch
    for 2 ranks, as `planner replan` does; the checkpoint of step 2 written by 4 ranks is resumed under the
    new layout, and every step trained ends where the uninterrupted run's does."""
    from planner import api
    from planner.plans import Plan
    from test_runtime import ROOT, free_port
    planner = str(Path(sys.executable).with_name("planner"))
    before, after, ckpt = tmp_path / "p4.yaml", tmp_path / "p2.yaml", tmp_path / "ckpt"
    api.plan("tiny-llama", device="cpu", num_devices=4, devices_per_node=2, global_batch=8,
             stack="parallel-planner").save(before)
    replanned = subprocess.run([planner, "replan", str(before), "--num-devices", "2", "--out", str(after)],
                               check=True, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "replanned from 4 to 2 devices, global batch 8 kept" in replanned.stdout
    assert Plan.load(after).num_devices == 2 and Plan.load(after).layout.gbs == 8
    common = ["--model", "tiny-llama", "--plan", str(before), "--steps", "6", *TRAIN, "--precision", "fp32",
              "--checkpoint-dir", str(ckpt), "--save-every", "2"]
    refused = launch(1, *common, check=False)   # another number of ranks, not without --elastic
    assert refused.returncode == 2 and "the plan is for 4 devices but the job has 1 rank (--elastic" in refused.stderr
    port, args = free_port(), [*common, "--elastic", "--inject", "node@4:2", "--collective-timeout", "10"]
    second = two_nodes(port, args, tmp_path)
    assert second.returncode == -signal.SIGKILL   # the lost node's agent
    out, err = (tmp_path / "node0.out").read_text(), (tmp_path / "node0.err").read_text()
    named = [named_behind(line) for line in err.replace("health: ", "\nhealth: ").splitlines()
             if line.startswith("health:") and "did not reach step 4" in line]
    assert named and all(2 in ranks and ranks <= {2, 3} for ranks in named), err   # the lost node's ranks only
    assert "note: replanned from 4 to 2 devices, global batch 8 kept" in err
    assert "resumed from step-000002 (restart 1)" in err
    trained = {int(line.split()[1]): float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]   # step 3 trained twice: after the loss, from step 2's checkpoint
    assert [trained[step] for step in range(1, 7)] == pytest.approx(references["plain"], rel=LOSS_TOLERANCE)


def test_a_node_computing_wrong_is_excluded_and_the_rest_go_on(tmp_path, references):
    """Two torchrun agents, two nodes of 2 CPUs, a 4-device plan, every product checked, `--on-sdc exclude`: at
    step 4 rank 2's device turns defective (`defect@4:2`: a wrong element in one product of every step, and of
    its self-test). Every rank learns it before any update uses it; rank 2's self-test fails; rank 0 names node
    1 and why and records it in excluded-nodes.json; node 1 leaves (its agent and workers end), the agent left
    restarts its workers, --elastic plans for 2 ranks, and the run resumes from step 2's checkpoint and ends
    where the uninterrupted run does."""
    from planner import api
    from test_runtime import free_port
    plan, ckpt = tmp_path / "p4.yaml", tmp_path / "ckpt"
    api.plan("tiny-llama", device="cpu", num_devices=4, devices_per_node=2, global_batch=8,
             stack="parallel-planner").save(plan)
    port = free_port()
    args = ["--model", "tiny-llama", "--plan", str(plan), "--steps", "6", *TRAIN, "--precision", "fp32",
            "--checkpoint-dir", str(ckpt), "--save-every", "2", "--elastic", "--inject", "defect@4:2",
            "--gemm-every", "1", "--on-sdc", "exclude", "--collective-timeout", "10"]
    second = two_nodes(port, args, tmp_path)
    assert second.returncode == -signal.SIGKILL   # the excluded node's agent, ended so that it never rejoins
    out, err = (tmp_path / "node0.out").read_text(), (tmp_path / "node0.err").read_text()
    found = [line for line in err.splitlines() if line.startswith("health: step 4: a wrong matrix product")]
    assert found and "on rank 2: node 1 (" in found[0] and "(its self-test failed) excluded (policy exclude); the " \
        "job restarts on node 0" in found[0], err[-3000:]
    assert "self-test, a product of known result 8 times: FAILED" in (tmp_path / "node1.err").read_text()
    record = json.loads((ckpt / "excluded-nodes.json").read_text())
    assert record[0]["ranks"] == [2] and record[0]["nodes"][0].startswith("node 1 (") and record[0]["step"] == 4
    assert record[0]["why"] == ["its self-test failed"]
    assert "note: replanned from 4 to 2 devices, global batch 8 kept" in err
    assert "resumed from step-000002 (restart 1)" in err
    trained = {int(line.split()[1]): float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]   # 3 and 4 trained again on the node left
    assert [trained[step] for step in range(1, 7)] == pytest.approx(references["plain"], rel=LOSS_TOLERANCE)


def test_an_error_of_a_ranks_own_code_is_not_called_a_failed_collective():
    """A step that fails in the model's own computation (here transformers' grouped-mm kernel, as a
    runtime bug once made it fail) is said as that rank's error with its traceback, not as a collective
    that timed out; the backends' transport errors (as gloo printed them in these tests) and torch's
    distributed errors are collective failures."""
    import torch.distributed as dist

    from runtime.watchdog import is_collective_failure
    assert not is_collective_failure(RuntimeError("matrix batch sizes have to match"))
    assert not is_collective_failure(ValueError("too many values to unpack"))
    assert is_collective_failure(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                              "Connection closed by peer [127.0.0.1]:29363"))
    assert is_collective_failure(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                                              "unbound_buffer.cc:78] Timed out waiting 300000ms for recv operation"))
    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted"))


def test_the_fingerprint_changes_with_any_single_flipped_bit_and_the_flag_with_any_non_finite_value():
    """Brute force over every bit position of fp32 and bf16 parameters (odd sizes included, where the bytes
    do not fill 64-bit words): one flipped bit always changes the fingerprint, flipped back it is restored.
    The non-finite flag is raised by one NaN or Inf anywhere (gradients or loss) and leaves values as they were."""
    import torch

    from runtime.health import HealthMonitor
    from runtime.replica_check import fingerprint
    generator = torch.Generator().manual_seed(0)
    for dtype, words in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        params = [torch.randn(shape, generator=generator).to(dtype) for shape in ((7, 3), (5,), (1,))]
        clean = fingerprint(params)
        for param in params:
            bits = param.view(-1).view(words)
            for index in (0, bits.numel() - 1):
                for bit in range(bits.element_size() * 8):
                    mask = torch.tensor(1 << bit, dtype=torch.int64).to(words)   # wraps to the sign bit
                    bits[index] ^= mask
                    assert fingerprint(params) != clean, (dtype, index, bit)
                    bits[index] ^= mask
        assert fingerprint(params) == clean
    monitor = HealthMonitor.__new__(HealthMonitor)   # the flag needs no process group (__init__ reads the rank)
    monitor.found = monitor.unit = None
    grads = [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator).bfloat16()]
    copies = [g.clone() for g in grads]
    loss = torch.tensor(2.5)
    assert float(monitor.nonfinite_flag(loss, grads)) == 0
    assert all(torch.equal(g, c) for g, c in zip(grads, copies)) and float(loss) == 2.5
    for value in (float("nan"), float("inf"), -float("inf")):
        for target in (grads[0], grads[1], loss.view(1)):
            kept = target.view(-1)[0].item()
            target.view(-1)[0] = value
            assert float(monitor.nonfinite_flag(loss, grads)) == 1, (value, target.shape)
            target.view(-1)[0] = kept
