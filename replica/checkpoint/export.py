"""A Replica checkpoint's weights as a Hugging Face model directory: ``model.safetensors``, or
shards and the index ``save_pretrained`` writes (``replica export`` on the command line)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from replica.checkpoint.store import MANIFEST, CheckpointError, _fsync_dir, _write, checkpoints, read_manifest, resolve
from replica.checkpoint.tensors import StoredWeights
from replica.errors import ConfigError
from replica.weights import write_safetensors

__all__ = ["export_safetensors"]

_EXPORTED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")  # what save_pretrained names
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes(value: int | str | None) -> int | None:
    """``max_shard_bytes`` as a count: an int, or a size as ``save_pretrained``'s ``max_shard_size``
    takes it ("5GB" is 5 * 10**9 bytes, "5GiB" 5 * 2**30)."""
    if value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m[2].upper() in _UNITS:
            value = int(float(m[1]) * _UNITS[m[2].upper()])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_shard_bytes must be a positive number of bytes or a size such as '5GB' or "
                          f"'500MiB', got {value!r}; None writes one model.safetensors")
    return value


def _exported_names(stored: StoredWeights) -> list[str]:
    """The names to export: every stored one but the tied duplicates. Hugging Face stores a tied
    weight once, under its first name (GPT-2: ``transformer.wte.weight``, not ``lm_head.weight``),
    and safetensors refuses shared storage. Ties come from the manifest (the Trainer records the
    plan's); in a format-1 checkpoint also from storage shared within a shard."""
    tied = read_manifest(stored.path).get("tied_parameters", {})
    dropped = {alias for name, aliases in tied.items() if name in stored.specs for alias in aliases}
    seen: dict[tuple[Any, ...], str] = {}
    names = []
    for name in stored.specs:
        if name in dropped:
            continue
        if stored.legacy:
            t = stored.read(name)  # memory-mapped: no bytes read
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
            if t.numel() and key in seen:
                continue
            seen.setdefault(key, name)
        names.append(name)
    return names


def _nbytes(spec: tuple[tuple[int, ...], torch.dtype]) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def _shard_plan(names: list[str], stored: StoredWeights, limit: int | None) -> list[list[str]]:
    """Names grouped into files in model order, as ``save_pretrained`` does: a file takes tensors
    until the next would pass ``limit``; a tensor larger than ``limit`` gets a file of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(stored.specs[name])
        if limit is not None and shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def exported_from(step_path: Path) -> dict[str, str]:
    """What an export records of its source (safetensors metadata are strings): the checkpoint
    step directory and its step, e.g. ``{"replica_checkpoint": ".../step-00000012", "replica_step": "12"}``."""
    found = re.fullmatch(r"step-(\d+)", step_path.name)
    return {"replica_checkpoint": str(step_path), **({"replica_step": str(int(found[1]))} if found else {})}


def export_safetensors(checkpoint_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                       max_shard_bytes: int | str | None = None, overwrite: bool = False) -> Path:
    """Write a Replica checkpoint's weights, under their original names, as a Hugging Face model
    directory's weights: ``out_dir/model.safetensors``, or with ``max_shard_bytes`` (an int, or
    ``"5GB"`` as ``save_pretrained``'s ``max_shard_size``) ``model-0000i-of-0000n.safetensors``
    files and the ``model.safetensors.index.json`` that ``save_pretrained`` writes
    (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``). Returns the file to load;
    its metadata name the step exported (:func:`exported_from`: ``replica_step``, ``replica_checkpoint``).

    ``checkpoint_path``: a ``checkpoint_dir`` (its newest good step) or one ``step-XXXXXXXX``
    directory, checksums verified. Tensors are read one at a time (DCP: that name alone) and
    written as read, so no more than one tensor is held in memory; tied duplicates are left out (see
    :func:`_exported_names`). Add the model's config (``config.save_pretrained(out_dir)``) and
    ``from_pretrained(out_dir)`` loads it; so does ``replica.auto_parallel(..., weights=out_dir)``.
    An ``out_dir`` already holding such files is refused unless ``overwrite``: then they are
    replaced, and stale shards of an earlier export removed. Files are written under temporary
    names and renamed into place at the end, the index last.
    """
    source, out = Path(checkpoint_path), Path(out_dir)
    limit = _bytes(max_shard_bytes)
    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite must be True or False, got {overwrite!r}")
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; pass a checkpoint_dir the trainer wrote "
                              "(config.checkpoint_dir), or one of its step-XXXXXXXX directories")
    if source.is_dir() and not (source / MANIFEST).exists() and not checkpoints(source) and any(
            _EXPORTED.match(p.name) for p in source.iterdir()):
        raise CheckpointError(f"{source} holds safetensors weights, not a Replica checkpoint: it already is a "
                              "Hugging Face directory; load it with from_pretrained or weights=")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {out} is a file; pass a directory (it is created if missing)")
    held = sorted(p.name for p in out.iterdir() if _EXPORTED.match(p.name)) if out.is_dir() else []
    if held and not overwrite:
        raise ConfigError(f"out_dir {out} already holds model weights ({', '.join(held[:4])}"
                          f"{', ...' if len(held) > 4 else ''}); pass overwrite=True (CLI: --overwrite) to replace "
                          "them, or choose another directory")
    stored = StoredWeights(resolve(source))
    if not stored.specs:
        raise CheckpointError(f"checkpoint {stored.path} holds no model weights; export a checkpoint the trainer wrote")
    names = _exported_names(stored)
    shards = _shard_plan(names, stored, limit)
    specs = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in stored.specs.items()}
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.tmp-{os.getpid()}" for name in files}
    written = 0
    try:
        for file, shard in zip(files, shards):
            written += write_safetensors(tmp[file], [(n, specs[n]) for n in shard],
                                         metadata={"format": "pt", **exported_from(stored.path)}, read=stored.read)
        index = None
        if len(files) > 1:
            weight_map = {n: file for file, shard in zip(files, shards) for n in shard}
            total_parameters = sum(math.prod(stored.specs[n][0]) for n in names)
            index = json.dumps({"metadata": {"total_size": written, "total_parameters": total_parameters,
                                             **exported_from(stored.path)},
                                "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        for stale in held:  # an earlier export's files this one does not replace
            if stale not in files:
                (out / stale).unlink()
        for file in files:
            os.replace(tmp[file], out / file)
        if index is not None:
            _write(out / "model.safetensors.index.json", index.encode())
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    _fsync_dir(out)
    return out / ("model.safetensors" if len(files) == 1 else "model.safetensors.index.json")
