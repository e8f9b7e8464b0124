"""Verified checkpoints: a manifest of what a checkpoint wrote, checked before anything is loaded from it.

DCP writes one `.metadata` (rank 0) and each rank's `__R_I.distcp` shards. Once every rank finished writing
(synchronously, or when `dcp.async_save`'s future resolved), each rank hashes the files it wrote (SHA-256,
read back from the page cache it just filled) and rank 0 writes `manifest.json`: every file's size and hash,
the step, the optimizer class and the model's parameter names and shapes. Only then does the checkpoint become
`latest` (runtime/checkpointing.py).

Before a load, the ranks share the files out, each re-hashes its share, and any difference, a missing or extra
shard, a `.metadata` that does not parse, another model's parameters or another optimizer's state is one line
naming the file and the cause; the restore then takes the newest checkpoint that verifies (`newest_usable`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-\d{6,}$")
HASH_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Identity:
    """What a checkpoint is of: the optimizer class and the model's parameters (full-model names and shapes)."""
    optimizer: str
    parameters: dict[str, list[int]]


class CheckpointFailed(Exception):
    """A save that did not complete on every rank (disk full, a write error, a rank lost during it)."""


class CheckpointRefused(Exception):
    """A checkpoint that cannot be trusted or does not fit this job; the message names the file and the cause."""


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _own_files(target: Path, rank: int) -> list[Path]:
    """The files this rank wrote: its shards, and `.metadata` on rank 0 (DCP's coordinator)."""
    files = sorted(target.glob(f"__{rank}_*.distcp"))
    return files + [target / ".metadata"] if rank == 0 else files


def write_manifest(target: Path, step: int, identity: Identity) -> None:
    """Every rank hashes what it wrote; rank 0 writes the manifest (the parameters every rank holds). Collective;
    a failure on any rank is CheckpointFailed on every rank."""
    rank = dist.get_rank()
    try:
        mine = {path.name: {"bytes": path.stat().st_size, "sha256": file_hash(path)}
                for path in _own_files(target, rank)}
    except OSError as exc:
        mine = f"rank {rank} cannot read back what it wrote ({exc})"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, identity.parameters))
    failed = next((part for part, _ in everyone if isinstance(part, str)), None)
    if rank == 0 and failed is None:
        files = {name: entry for part, _ in everyone for name, entry in part.items()}
        parameters = {name: shape for _, held in everyone for name, shape in held.items()}
        manifest = {"step": step, "optimizer": identity.optimizer, "parameters": dict(sorted(parameters.items())),
                    "files": dict(sorted(files.items()))}
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
