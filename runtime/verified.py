"""Verified checkpoints: a manifest of what a checkpoint wrote, checked before anything is loaded from it.

DCP writes one `.metadata` (rank 0) and each rank's `__R_I.distcp` shards, through a `HashingWriter`: its file
system hashes (SHA-256) every byte as it passes to the file, so that nothing is read back. Once every rank
finished writing (synchronously, or when `dcp.async_save`'s future resolved), rank 0 writes `manifest.json`:
every file's size and hash, the step, the optimizer class and the model's parameter names and shapes. Only then
does the checkpoint become `latest` (runtime/checkpointing.py).

Before a load, the ranks share the files out, each re-hashes its share, and any difference, a missing or extra
shard, a `.metadata` that does not parse, another model's parameters or another optimizer's state is one line
naming the file and the cause; the restore then takes the newest checkpoint that verifies (`newest_usable`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-\d{6,}$")
HASH_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Identity:
    """What a checkpoint is of: the optimizer class and the model's parameters (full-model names and shapes)."""
    optimizer: str
    parameters: dict[str, list[int]]


class CheckpointFailed(Exception):
    """A save that did not complete on every rank (disk full, a write error, a rank lost during it); `error` the
    underlying one (a failed collective: a rank was lost), `step` the step whose checkpoint it was."""

    def __init__(self, message: str, error: BaseException | None = None, step: int | None = None):
        super().__init__(message)
        self.error, self.step = error, step


class CheckpointRefused(Exception):
    """A checkpoint that cannot be trusted or does not fit this job; the message names the file and the cause."""


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingStream:
    """A file being written, hashed on the way: the digest of exactly the bytes written, in order (DCP writes
    each file front to back and never seeks)."""

    def __init__(self, raw):
        self.raw, self.digest, self.bytes = raw, hashlib.sha256(), 0
        self.error: OSError | None = None   # the file's own write error (torch.save's writer hides it)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self.raw.write(view)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(view[:written])
        self.bytes += written
        return written

    def __getattr__(self, name):   # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and SHA-256 of every file it writes (by its final name:
    `.metadata` is written as a temporary file and renamed)."""

    def __init__(self):
        self.written: dict[str, dict] = {}
        self._lock = threading.Lock()   # DCP may write a rank's files from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = self.stream_for(stream)
            try:
                yield hashing
            except Exception as exc:   # torch.save reports a failed write as "unexpected pos": the cause is said
                if hashing.error is not None and hashing.error is not exc:
                    raise hashing.error from None
                raise
        with self._lock:   # only a file whose writing ended without an error
            self.written[Path(path).name] = {"bytes": hashing.bytes, "sha256": hashing.digest.hexdigest()}

    def stream_for(self, raw) -> _HashingStream:
        return _HashingStream(raw)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter over a `HashingFileSystem` (or a subclass: runtime/faults.py's full disk)."""

    def __init__(self, path: str | os.PathLike, file_system: HashingFileSystem | None = None):
        super().__init__(path)
        self.fs = file_system or HashingFileSystem()

    def written(self) -> dict[str, dict]:
        """Name -> {"bytes", "sha256"} of every file this rank wrote into the checkpoint."""
        return dict(self.fs.written)


def write_manifest(target: Path, step: int, identity: Identity, written: dict[str, dict],
                   checks: dict | None = None) -> None:
    """Every rank's hashes of what it wrote (`HashingWriter.written`), gathered; rank 0 writes the manifest (the
    parameters every rank holds, and `checks`: the verdict of the health checks before it). Collective; a
    failure on any rank is CheckpointFailed on every rank."""
    rank = dist.get_rank()
    mine = {name: entry for name, entry in written.items() if name == ".metadata" or name.endswith(".distcp")}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, identity.parameters))
    failed = None
    if rank == 0:
        files = {name: entry for part, _ in everyone for name, entry in part.items()}
        parameters = {name: shape for _, held in everyone for name, shape in held.items()}
        manifest = {"step": step, "optimizer": identity.optimizer, "checks": checks or {},
                    "parameters": dict(sorted(parameters.items())), "files": dict(sorted(files.items()))}
        try:
            temporary = target / f".{MANIFEST}.tmp"
            temporary.write_text(json.dumps(manifest, indent=1))
            temporary.replace(target / MANIFEST)
        except OSError as exc:
            failed = f"rank 0 cannot write {target / MANIFEST} ({exc})"
    outcome: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcome, failed)
    failed = next((part for part in outcome if part), None)
    if failed:
        raise CheckpointFailed(f"checkpoint {target.name}: {failed}")


def _problem_of_files(target: Path, manifest: dict) -> str | None:
    """This rank's share of the file check (files shared out by index); the first problem found, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listed = manifest.get("files")
    if not isinstance(listed, dict) or ".metadata" not in listed:
        return f"{target / MANIFEST}: lists no files"
    present = {path.name for path in target.iterdir() if path.name == ".metadata" or path.suffix == ".distcp"}
    if present != set(listed):
        missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
        return f"{target}: " + ("missing " + ", ".join(missing) if missing else "unlisted " + ", ".join(extra))
    for index, (name, entry) in enumerate(sorted(listed.items())):
        if index % world != rank:
            continue
        path = target / name
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{path}: {size:,} bytes where {entry.get('bytes'):,} were written (truncated or overwritten)"
        if file_hash(path) != entry.get("sha256"):
            return f"{path}: its SHA-256 differs from the one written (the bytes changed after the save)"
    return None


def _problem_of_identity(target: Path, manifest: dict, identity: Identity, with_optimizer: bool) -> str | None:
    if with_optimizer and manifest.get("optimizer") != identity.optimizer:
        return (f"{target}: written with {manifest.get('optimizer')}'s state, this job trains with "
                f"{identity.optimizer} (resume with --drop-optimizer-state to start its state anew)")
    saved = manifest.get("parameters") or {}
    for name, shape in identity.parameters.items():
        if name not in saved:
            return f"{target}: holds no parameter '{name}' (a checkpoint of another model)"
        if saved[name] != shape:
            return f"{target}: parameter '{name}' has shape {saved[name]}, this model's is {shape}"
    return None


def problem_of(target: Path, identity: Identity, with_optimizer: bool = True) -> str | None:
    """Why `target` cannot be loaded by this job (the same answer on every rank), or None. Collective."""
    manifest_path = target / MANIFEST
    problem = None
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        problem, manifest = f"{manifest_path}: missing (the save did not complete, or predates manifests)", None
    except (OSError, ValueError) as exc:
        problem, manifest = f"{manifest_path}: unreadable ({exc})", None
    if manifest is not None:
        problem = _problem_of_files(target, manifest) or _problem_of_identity(target, manifest, identity,
                                                                             with_optimizer)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p), None)


def candidates(directory: Path, latest_name: str | None) -> list[Path]:
    """The directory's checkpoints, newest first: `latest`'s, then the older ones it superseded."""
    steps = sorted((p for p in directory.glob("step-*") if STEP_DIR.match(p.name) and p.is_dir()), reverse=True)
    if latest_name is None:
        return steps
    return [p for p in steps if p.name <= latest_name]


def newest_usable(directory: Path, latest_name: str | None, identity: Identity, say) -> Path | None:
    """The newest checkpoint that verifies, each refused one said in a line; None where none exists. A directory
    whose checkpoints are all of another model or optimizer is refused as a whole (CheckpointRefused)."""
    refused = []
    for target in candidates(directory, latest_name):
        problem = problem_of(target, identity)
        if problem is None:
            return target
        if problem.startswith(str(target / MANIFEST)) and "missing" in problem and latest_name is None:
            say(f"health: checkpoint {target.name} skipped: its save never completed ({MANIFEST} missing)")
            continue   # a save a failure interrupted before any checkpoint became latest
        refused.append(problem)
        say(f"health: checkpoint {target.name} refused: {problem}")
    if refused:
        raise CheckpointRefused(f"no checkpoint in {directory} can be resumed: {refused[0]}"
                                + (f" (and {len(refused) - 1} more refused)" if len(refused) > 1 else ""))
    return None
