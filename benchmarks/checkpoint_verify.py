"""What verified checkpoints cost (runtime/verified.py): for a state of S MB in one process, the synchronous DCP
save through DCP's own FileSystemWriter, the same save through the HashingWriter (every byte hashed with
SHA-256 as it is written), the manifest written after it (the hashes gathered, one JSON file) and the check
before a load (every file read and hashed again), each the median of --repeats. The hashing writer's extra time
over the plain save is what a synchronous checkpoint blocks on in addition; under --async-save it runs in the
write's own thread, beside training. Results and the command: docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_verify.py [--sizes-mb 64,512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from runtime.process_group import end_distributed, init_distributed  # noqa: E402
from runtime.verified import HashingWriter, Identity, problem_of, write_manifest  # noqa: E402

SHARD_MB = 16   # tensors of this size, as a model's parameters and moments would be


def state_of(size_mb: int) -> dict[str, torch.Tensor]:
    count = max(1, size_mb // SHARD_MB)
    return {f"model/w{i}": torch.randn(SHARD_MB << 18) for i in range(count)}   # 4-byte floats


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(size_mb: int, repeats: int, root: Path) -> tuple[float, float, float, float]:
    """Medians of: the plain save, the hashing save, the manifest after it, the check before a load."""
    state = state_of(size_mb)
    identity = Identity("AdamW", {key: list(value.shape) for key, value in state.items()})
    plain, hashing, manifests, checks = [], [], [], []
    for repeat in range(repeats):
        plain.append(timed(lambda: dcp.save(state, checkpoint_id=str(root / f"{size_mb}-plain-{repeat}"))))
        target = root / f"{size_mb}-{repeat}"
        writer = HashingWriter(target)
        hashing.append(timed(lambda: dcp.save(state, checkpoint_id=str(target), storage_writer=writer)))
        manifests.append(timed(lambda: write_manifest(target, repeat, identity, writer.written())))
        checks.append(timed(lambda: problem_of(target, identity)))
        assert problem_of(target, identity) is None   # the hashes taken while writing are the files' own
    return tuple(statistics.median(values) for values in (plain, hashing, manifests, checks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="64,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    init_distributed("cpu")
    print("| state | DCP save | hashed as written | extra | manifest | check before load | check rate |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for size in (int(s) for s in args.sizes_mb.split(",")):
            plain_s, hashing_s, manifest_s, check_s = measure(size, args.repeats, Path(root))
            print(f"| {size} MB | {plain_s:.3f} s | {hashing_s:.3f} s | {hashing_s / plain_s - 1:+.0%} "
                  f"| {manifest_s * 1000:.1f} ms | {check_s:.3f} s | {size / 1024 / check_s:.2f} GB/s |")
    end_distributed()


if __name__ == "__main__":
    main()
