"""Reading the weights a rank holds, by name, from safetensors files, HF directories or Replica checkpoints;
and writing safetensors files tensor by tensor (:func:`write_safetensors`, for checkpoint export)."""

from __future__ import annotations

import difflib
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from replica.checkpoint import store as ckpt
from replica.checkpoint.tensors import StoredWeights
from replica.errors import ConfigError, ReplicaError

__all__ = ["WeightsError", "read_weights", "wanted_from", "write_safetensors"]

Wanted = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}.items()
    if hasattr(torch, name)}
_SAFETENSORS_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
_LISTED = 10  # names shown per kind of problem
_STEP = re.compile(r"^step-\d{8,}$")  # as replica.checkpoint.store names them


class WeightsError(ReplicaError):
    """Weights could not be read: a missing or unreadable file, or names and shapes that do not fit the model."""


def wanted_from(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``read_weights``'s ``wanted`` for a state_dict (or a slice of one): each name's shape and dtype."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


class _Safetensors:
    """Stored names from headers or an index; a shard is opened when one of its tensors is first asked for."""

    def __init__(self, where: dict[str, Path], files: ExitStack, description: str) -> None:
        self.where, self.files, self.description = where, files, description
        self.opened: dict[Path, Any] = {}

    @classmethod
    def of_file(cls, file: Path, files: ExitStack) -> _Safetensors:
        self = cls({}, files, f"safetensors file {file}")
        self.where = dict.fromkeys(self._open(file).keys(), file)
        return self

    def _open(self, file: Path) -> Any:
        if file not in self.opened:
            try:
                self.opened[file] = self.files.enter_context(safe_open(str(file), framework="pt"))
            except Exception as exc:  # SafetensorError, OSError: a truncated header, a pickle, a text file
                raise WeightsError(
                    f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc}); re-download or "
                    "re-save it, or convert a PyTorch file with safetensors.torch.save_file(torch.load(f))"
                ) from None
        return self.opened[file]

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        view = self._open(self.where[name]).get_slice(name)
        return tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(view.get_dtype())

    def read(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._open(self.where[name]).get_tensor(name)
        return tensor


class _Stored:
    """A Replica checkpoint's weights: names and shapes from its index, each tensor read when asked for."""

    def __init__(self, stored: StoredWeights, description: str) -> None:
        self.stored, self.description = stored, description
        self.where = stored.specs

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        return self.stored.specs[name]

    def read(self, name: str) -> torch.Tensor:
        return self.stored.read(name)


def _index(index: Path, files: ExitStack) -> _Safetensors:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {str(name): index.parent / str(shard) for name, shard in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{index} is not a safetensors index with a 'weight_map' ({type(exc).__name__}: "
                           f"{exc}); re-download it or save the model again") from None
    absent = sorted({f.name for f in where.values() if not f.is_file()})
    if absent:
        raise WeightsError(f"{index} names {len(absent)} shard(s) missing from {index.parent}: {absent[:_LISTED]}; "
                           "the download or copy is incomplete: fetch those files")
    return _Safetensors(where, files, f"sharded safetensors index {index} ({len(set(where.values()))} shards)")


def _replica(path: Path) -> _Stored:
    """The newest complete step under a checkpoint_dir (or a step directory itself): manifest present and
    every file of the size it records. Checksums are not taken: that would read every byte."""
    steps = [path] if (path / ckpt.MANIFEST).exists() or _STEP.match(path.name) else ckpt.checkpoints(path)
    problems = []
    for step in reversed(steps):
        try:
            manifest = ckpt.read_manifest(step)
            files = sorted(manifest["files"])
            wrong = [n for n in files if not (step / n).is_file()
                     or (step / n).stat().st_size != manifest["files"][n]["bytes"]]
            if wrong or not files:
                raise ckpt.CheckpointError(f"{step}: files {wrong or files} are missing or truncated")
            stored = StoredWeights(step)
        except ckpt.CheckpointError as exc:
            problems.append(str(exc))
            continue
        return _Stored(stored, f"Replica checkpoint {step} ({len(stored.specs)} tensors)")
    raise WeightsError(f"no complete Replica checkpoint in {path}: {'; '.join(problems)}; pass a checkpoint_dir "
                       "the trainer wrote, or one of its complete step-XXXXXXXX directories")


def _source(path: Path, files: ExitStack) -> _Safetensors | _Stored:
    """What ``path`` is: a file, a Replica checkpoint, or a directory ``save_pretrained`` wrote."""
    if not path.exists():
        raise WeightsError(f"{path} does not exist; pass a .safetensors file, a directory save_pretrained wrote, "
                           "or a Replica checkpoint_dir")
    if path.is_file():
        return _index(path, files) if path.name.endswith(".index.json") else _Safetensors.of_file(path, files)
    if (path / ckpt.MANIFEST).exists() or _STEP.match(path.name) or ckpt.checkpoints(path):
        return _replica(path)
    for candidates, reader in ((["model.safetensors"], _Safetensors.of_file),
                               (["model.safetensors.index.json"], _index),
                               (sorted(p.name for p in path.glob("*.safetensors.index.json")), _index),
                               (sorted(p.name for p in path.glob("*.safetensors")), _Safetensors.of_file)):
        found = [path / c for c in candidates if (path / c).is_file()]
        if len(found) == 1:
            return reader(found[0], files)
    held = sorted(p.name for p in path.iterdir())
    more = " ..." if len(held) > _LISTED else ""
    raise WeightsError(
        f"{path} holds no weights read_weights recognises (it has {held[:_LISTED]}{more}): "
        "it wants model.safetensors, model.safetensors.index.json with its shards, exactly one *.safetensors file, "
        "or Replica step-XXXXXXXX directories; convert a pytorch_model.bin with safetensors.torch.save_file"
    )


def _renaming(names: Collection[str], stored: Collection[str]) -> tuple[str, Callable[[str], str]]:
    """One renaming for the whole checkpoint: as is, or the model's base prefix removed or added
    (``transformer.h.0`` <-> ``h.0``), whichever finds the most names; O(candidates * names)."""
    firsts = {n.split(".", 1)[0] + "." for n in names if "." in n}
    stored_firsts = {n.split(".", 1)[0] + "." for n in stored if "." in n}
    candidates: list[tuple[str, Callable[[str], str]]] = [("as stored", lambda n: n)]
    for p in sorted(firsts - stored_firsts):
        candidates.append((f"with prefix {p!r} removed", lambda n, p=p: n[len(p):] if n.startswith(p) else n))
    for p in sorted(stored_firsts - firsts):
        candidates.append((f"with prefix {p!r} added", lambda n, p=p: p + n))
    return max(candidates, key=lambda c: sum(c[1](n) in stored for n in names))  # ties: the first, as stored


def _listing(kind: str, lines: list[str]) -> str:
    more = f"\n    ... and {len(lines) - _LISTED} more" if len(lines) > _LISTED else ""
    return f"  {len(lines)} {kind}:\n" + "\n".join(f"    {line}" for line in lines[:_LISTED]) + more


def _check(wanted: Wanted) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for name, spec in wanted.items():
        try:
            shape, dtype = spec
            out[name] = (tuple(int(d) for d in shape), dtype)
        except (TypeError, ValueError):
            dtype = None
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"wanted[{name!r}] is {spec!r}; give (shape, dtype), e.g. ((768,), torch.float32), "
                              "or build wanted with replica.weights.wanted_from(model.state_dict())")
    return out


def read_weights(path: str | os.PathLike[str], wanted: Wanted, *, aliases: Mapping[str, Sequence[str]] = {},
                 all_names: Iterable[str] | None = None, strict_unexpected: bool = False,
                 device: torch.device | str = "cpu", fix: str | None = None) -> dict[str, torch.Tensor]:
    """Read the tensors named in ``wanted`` (state_dict names -> (shape, dtype)) from ``path``, and no others.

    ``path``: a ``.safetensors`` file or ``*.safetensors.index.json``; a directory ``save_pretrained``
    wrote (only the shards holding wanted names are opened); a Replica ``checkpoint_dir`` (its newest
    complete step) or one ``step-XXXXXXXX`` directory. Files are memory-mapped and read tensor by tensor.
    Stored names match as they are, or with the model's base prefix removed or added (``transformer.``,
    ``model.``), one choice for the whole checkpoint. A name not stored is taken from a tie partner:
    ``aliases`` maps a name to its other names, e.g. ``{"transformer.wte.weight": ("lm_head.weight",)}``.
    Each tensor is CAST to its wanted dtype and placed on ``device``; tied names share one tensor.
    With ``strict_unexpected``, a stored name that none of ``all_names`` (the whole model's names;
    default ``wanted``'s) matches is an error: the checkpoint is of another model.
    Raises :class:`WeightsError` before reading any tensor, listing every missing name (with the
    closest stored names), mis-shaped or mis-typed name and unexpected name at once, then ``fix``
    (default: check the model and config, pass ``aliases=`` and ``all_names=``).
    """
    wanted = _check(wanted)
    groups: dict[str, set[str]] = {}
    for canonical, others in aliases.items():
        group = {canonical, *others}.union(*(groups.get(n, set()) for n in (canonical, *others)))
        groups.update(dict.fromkeys(group, group))
    model_names = set(all_names) if all_names is not None else set(wanted).union(*(groups.get(n, ()) for n in wanted))
    with ExitStack() as files:
        source = _source(Path(path), files)
        stored = source.where.keys()
        how, rename = _renaming(model_names, stored)
        chosen: dict[str, str] = {}
        missing, misshaped, unexpected = [], [], []
        for name, (shape, dtype) in wanted.items():
            tied = sorted(groups.get(name, set()) - {name})
            key = next((rename(n) for n in (name, *tied) if rename(n) in stored), None)
            if key is None:  # the closest names only for those listed: difflib is slow on big checkpoints
                close = difflib.get_close_matches(rename(name), stored, n=3) if len(missing) < _LISTED else []
                as_stored = f" (looked for {rename(name)!r})" if rename(name) != name else ""
                missing.append(f"{name}{as_stored}; closest stored: {close or 'none'}")
                continue
            have, kind = source.meta(key)
            if have != shape:
                misshaped.append(f"{name}: stored {key} has shape {have}, the model's is {shape}")
            elif kind is not None and kind.is_floating_point != dtype.is_floating_point:
                misshaped.append(f"{name}: stored {key} is {kind}, the model's is {dtype}; casting would corrupt it")
            chosen[name] = key
        if strict_unexpected:
            known = {rename(n) for n in model_names}
            unexpected = sorted(k for k in stored if k not in known)
        if missing or misshaped or unexpected:
            parts = [_listing("missing", missing), _listing("mis-shaped or mis-typed", misshaped),
                     _listing("unexpected (stored, but the model has no such name)", unexpected)]
            raise WeightsError(
                f"{source.description} ({len(stored)} tensors, names matched {how}) does not fit the "
                f"{len(wanted)} wanted weights:\n" + "\n".join(p for p in parts if not p.startswith("  0 ")) + "\n" +
                (fix or "Check that the checkpoint is of this model and config; pass aliases= for tied weights "
                 "(e.g. {'transformer.wte.weight': ('lm_head.weight',)}) and all_names= the whole model's names.")
            )
        out: dict[str, torch.Tensor] = {}
        read: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        for name, key in chosen.items():
            dtype = wanted[name][1]
            if (key, dtype) not in read:  # copy=True: never hand out a memory-mapped file's own storage
                read[key, dtype] = source.read(key).to(device=device, dtype=dtype, copy=True)
            out[name] = read[key, dtype]
        return out


def write_safetensors(file: str | os.PathLike[str], tensors: Sequence[tuple[str, torch.Tensor]],
                      metadata: Mapping[str, str] | None = None,
                      read: Callable[[str], torch.Tensor] | None = None) -> int:
    """Write ``tensors`` (name, tensor) to ``file`` in the safetensors format, one tensor at a time;
    returns the bytes of tensor data written.

    ``safetensors.torch.save_file`` first copies every tensor of the file into bytes objects, so
    it holds a whole file in memory: exporting a model larger than memory needs this instead. The
    header is the format's own (8-byte little-endian length, JSON with dtype, shape and offsets,
    padded to 8 bytes); each tensor's bytes are copied from its (memory-mapped) storage as written.
    The file is opened with ``safetensors.safe_open`` after, which checks the header.
    Shared storage is written once per name: the caller drops tied duplicates. With ``read``,
    ``tensors`` may be meta tensors (shape and dtype only) and each one's bytes come from
    ``read(name)`` as it is written, so only one tensor is in memory at a time.
    """
    if sys.byteorder != "little":  # the format is little-endian; tensors are written as they lie in memory
        raise WeightsError("write_safetensors writes tensors as they lie in memory, which is only the safetensors "
                           "layout on a little-endian machine; export on an x86 or ARM host")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors:
        if name in header:
            raise WeightsError(f"write_safetensors: {name!r} is given twice; each name once")
        code = _SAFETENSORS_CODES.get(t.dtype)
        if code is None or t.layout != torch.strided or (t.is_meta and read is None):
            raise WeightsError(f"{name} is a {t.layout} {t.dtype} tensor on {t.device}, which safetensors cannot "
                               f"store; it stores dense tensors of {sorted(map(str, _SAFETENSORS_CODES))}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors:
            if t.numel():
                data = t if read is None else read(name)
                f.write(data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del data  # before the next one is read: one tensor in memory, not two
        f.flush()
        os.fsync(f.fileno())
    with safe_open(str(file), framework="pt") as check:  # the header parses and covers every byte
        if len(check.keys()) != len(tensors):
            raise WeightsError(f"{file} holds {len(check.keys())} tensors after writing {len(tensors)}")
    return offset
