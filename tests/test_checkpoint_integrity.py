"""Verified checkpoints (runtime/verified.py) through the driver, as a restarted job meets them: a checkpoint whose
bytes changed, a truncated or missing shard, a garbage .metadata, a `latest` marker that is not text or points
outside, another model's or another optimizer's checkpoint, and a save that fails (a write error: a file lies where
the step's directory goes). Each is named in one line, never a traceback; a corrupt checkpoint is passed over for
the newest that verifies and the losses after it are those of the run that never stopped; a failed save stops
training at that step, and the job started again resumes from the last verified checkpoint.
"""
import shutil
from pathlib import Path

import pytest

from test_runtime import LOSS_TOLERANCE, launch

pytestmark = pytest.mark.heavy

ARGS = ("--model", "tiny-llama", "--save-every", "2", "--optimizer", "adamw", "--lr", "0.001")
CHECKPOINT_ERROR = 5   # runtime.trainer.CHECKPOINT_ERROR


def step_losses(proc) -> dict[int, float]:
    return {int(line.split()[1]): float(line.split()[-1]) for line in proc.stdout.splitlines()
            if line.startswith("step ")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: steps 1-8, checkpoints every 2."""
    return step_losses(launch(1, *ARGS, "--steps", "8", "--checkpoint-dir", str(tmp_path_factory.mktemp("ref"))))


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A directory where a job stopped after step 6: checkpoints 2, 4 and 6, latest 6."""
    directory = tmp_path_factory.mktemp("six")
    launch(1, *ARGS, "--steps", "6", "--checkpoint-dir", str(directory))
    assert (directory / "latest").read_text() == "step-000006"
    return directory


def before_the_launchers_report(stderr: str) -> str:
    """What the ranks said, before torchrun's report of the exit statuses (which prints the launcher's stack)."""
    return stderr.split("torch/distributed/elastic/multiprocessing/api.py")[0]


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 64])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


FAULTS = {   # name: (what it does to the directory, the checkpoint resumed, words the line must hold)
    "flipped shard": (lambda d: flip(d / "step-000006" / "__0_0.distcp"), 4, ["__0_0.distcp", "SHA-256 differs"]),
    "truncated shard": (lambda d: truncate(d / "step-000006" / "__0_0.distcp"), 4, ["__0_0.distcp", "truncated"]),
    "missing shard": (lambda d: (d / "step-000006" / "__0_0.distcp").unlink(), 4, ["missing __0_0.distcp"]),
    "garbage metadata": (lambda d: (d / "step-000006" / ".metadata").write_bytes(
        bytes(range(256)) * (((d / "step-000006" / ".metadata").stat().st_size // 256) + 1)), 4, [".metadata"]),
    "no manifest": (lambda d: (d / "step-000006" / "manifest.json").unlink(), 4, ["manifest.json", "missing"]),
    "latest not text": (lambda d: (d / "latest").write_bytes(b"\xff\xfe\x00"), 6, ["names no checkpoint"]),
    "latest outside": (lambda d: (d / "latest").write_text("../../../etc"), 6, ["names no checkpoint"]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_checkpoint_is_named_and_the_newest_verified_one_resumed(reference, six_steps, tmp_path, fault):
    change, resumed, words = FAULTS[fault]
    directory = tmp_path / "ckpt"
    shutil.copytree(six_steps, directory)
    change(directory)
    proc = launch(1, *ARGS, "--steps", "8", "--checkpoint-dir", str(directory))
    said = [line for line in proc.stderr.splitlines() if line.startswith("health:")]
    assert said and all(word in said[0] for word in words), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"resumed from step-{resumed:06d}" in proc.stderr
    losses = step_losses(proc)
    assert sorted(losses) == list(range(resumed + 1, 9))
    assert all(abs(losses[s] - reference[s]) < LOSS_TOLERANCE for s in losses), (losses, reference)


@pytest.mark.parametrize("other, words", [(("--model", "tests/models/tiny-square-heads.yaml"), ["parameter"]),
                                          (("--optimizer", "sgd"), ["AdamW", "SGD"])])
def test_another_models_or_optimizers_checkpoint_is_refused_in_one_line(six_steps, tmp_path, other, words):
    directory = tmp_path / "ckpt"
    shutil.copytree(six_steps, directory)
    args = list(ARGS)
    for flag, value in zip(other[::2], other[1::2]):
        args[args.index(flag) + 1] = value
    proc = launch(1, *args, "--steps", "8", "--checkpoint-dir", str(directory), check=False)
    assert proc.returncode == CHECKPOINT_ERROR, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not step_losses(proc)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_save_stops_training_and_the_restart_resumes_the_last_verified(reference, tmp_path, asynchronous):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "step-000004").write_text("in the way")   # the save of step 4 cannot create its directory
    extra = ("--async-save",) if asynchronous else ()
    proc = launch(1, *ARGS, *extra, "--steps", "8", "--checkpoint-dir", str(directory), check=False)
    assert proc.returncode == CHECKPOINT_ERROR, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step-000004 failed: rank 0" in errors[0] and "step-000002 stays" in errors[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert max(step_losses(proc)) <= (5 if asynchronous else 4)   # async: known once the write ends
    (directory / "step-000004").unlink()
    again = launch(1, *ARGS, *extra, "--steps", "8", "--checkpoint-dir", str(directory))
    assert "resumed from step-000002" in again.stderr
    losses = step_losses(again)
    assert sorted(losses) == list(range(3, 9))
    assert all(abs(losses[s] - reference[s]) < LOSS_TOLERANCE for s in losses)


def test_a_flipped_shard_of_another_rank_is_found_by_the_ranks_together(reference, tmp_path):
    """dp2 ZeRO-1: both ranks write shards; rank 1's is flipped; the shared check names it on restart."""
    directory = tmp_path / "ckpt"
    launch(2, *ARGS, "--layout", "dp=2,zero=1", "--steps", "6", "--checkpoint-dir", str(directory))
    flip(directory / "step-000006" / "__1_0.distcp")
    proc = launch(2, *ARGS, "--layout", "dp=2,zero=1", "--steps", "8", "--checkpoint-dir", str(directory))
    assert "__1_0.distcp: its SHA-256 differs" in proc.stderr and "resumed from step-000004" in proc.stderr
    losses = step_losses(proc)
    assert sorted(losses) == [5, 6, 7, 8]
    assert all(abs(losses[s] - reference[s]) < LOSS_TOLERANCE for s in losses), (losses, reference)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_on_one_rank_is_named_and_training_stops_at_that_save(reference, tmp_path, asynchronous):
    """dp2 ZeRO-1: rank 1's disk fills while it writes the checkpoint of step 4 (ENOSPC after 4 KiB of its
    shard): one error line naming rank 1 and the cause on every rank, no traceback, no step trained past the
    failure once known; the job started again resumes from step 2's checkpoint as the uninterrupted run."""
    directory = tmp_path / "ckpt"
    extra = ("--async-save",) if asynchronous else ()
    layout = ("--layout", "dp=2,zero=1")
    # a replica check every step: one is in flight (read in the next step) wherever the job stops
    proc = launch(2, *ARGS, *layout, *extra, "--steps", "8", "--checkpoint-dir", str(directory),
                  "--inject", "diskfull@4:1", "--sdc-every", "1", check=False)
    assert proc.returncode != 0
    assert "exitcode: 5" in proc.stderr and "terminate called" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "step-000004 failed: rank 1: OSError: [Errno 28] No space left on device" in errors[0] \
        and "step-000002 stays the latest" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in before_the_launchers_report(proc.stderr)   # torchrun's own ends in one (exit 5)
    # async: training goes on while the write runs, and stops at the first step after every rank's has ended
    assert max(step_losses(proc)) <= (6 if asynchronous else 4)
    assert (directory / "latest").read_text() == "step-000002"
    again = launch(2, *ARGS, *layout, *extra, "--steps", "8", "--checkpoint-dir", str(directory))
    assert "resumed from step-000002" in again.stderr
    losses = step_losses(again)
    assert sorted(losses) == list(range(3, 9))
    assert all(abs(losses[s] - reference[s]) < LOSS_TOLERANCE for s in losses), (losses, reference)


def test_a_rank_lost_during_a_save_is_named_and_the_restart_resumes_the_last_verified(reference, tmp_path):
    """torchrun --max-restarts 1, dp2: rank 1 dies (SIGKILL) in the middle of writing step 4's checkpoint; rank 0,
    whose save fails in DCP's collective, names rank 1 in one health line (no traceback); the restarted job
    resumes from step 2's checkpoint and trains steps 3..8 as the run that never failed."""
    import subprocess
    import sys

    from test_runtime import DRIVER, ENV, ROOT, free_port
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *DRIVER,
               *ARGS, "--layout", "dp=2", "--steps", "8", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--inject", "savekill@4:1", "--collective-timeout", "10"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("health:")]
    assert any("the checkpoint after step 4 failed in a collective; rank 1 lost during it" in line
               for line in said), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "resumed from step-000002 (restart 1)" in proc.stderr
    losses = step_losses(proc)
    assert sorted(losses) == list(range(1, 9))
    assert all(abs(losses[s] - reference[s]) < LOSS_TOLERANCE for s in losses), (losses, reference)
