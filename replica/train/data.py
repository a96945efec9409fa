"""Batches for the trainer: a seeded order per epoch, tensors, datasets or loaders, small last batches merged.

Every rank builds the same batches from the same data: the order of epoch ``e`` is
``randperm(n)`` from a generator seeded with ``(seed, e)`` alone, and batch boundaries
never depend on the pipeline's layout, so a resumed run (with any number of stages or
ranks) sees exactly the batches an uninterrupted one would. For training, a partial
last batch is MERGED into the batch before it (that step takes ``batch_size + r``
samples): no sample is dropped, and no batch is ever smaller than the pipeline needs
(a whole batch always holds at least micro-batches × replicas samples).

Inputs are positional (a tensor, or a tuple of them: ``model(*x)``) or keywords (a dict of
tensors: ``model(**x)``, as Hugging Face batches are); every tensor has the samples along dim 0.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Union

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from replica.errors import ConfigError

__all__ = ["Batch", "Inputs", "DataSource", "LoaderSource", "make_source", "epoch_order", "num_samples_in",
           "pad"]

Inputs = Union[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]  # model(*inputs) or model(**inputs)
Batch = tuple[Inputs, Any]  # (inputs, target)


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """Sample indices of one epoch: a permutation drawn from ``(seed, epoch)`` only, or ``arange``."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_samples, generator=generator)


def _chunks(order: torch.Tensor, batch_size: int, merge_last: bool) -> list[torch.Tensor]:
    """Batches of ``batch_size`` indices; with ``merge_last`` a partial last one joins the one before."""
    chunks = list(torch.split(order, batch_size))
    if merge_last and len(chunks) > 1 and len(chunks[-1]) < batch_size:
        last = chunks.pop()
        chunks[-1] = torch.cat([chunks[-1], last])
    return chunks


def num_samples_in(inputs: Inputs) -> int:
    """The samples of a batch's inputs: dim 0 of the first tensor."""
    return int(tree_leaves(inputs)[0].shape[0])


def _as_inputs(x: Any, what: str = "x") -> Inputs:
    if isinstance(x, Mapping):
        return _keywords(x, what)
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _keywords(x: Mapping[str, Any], what: str) -> dict[str, torch.Tensor]:
    """A dict of keyword inputs, checked: every value a tensor, all with the same dim 0."""
    if not x:
        raise ConfigError(f"{what} is an empty dict; pass the model's keyword inputs, e.g. {{'input_ids': ids}}")
    first = None
    for key, value in x.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            got = "a 0-dim tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise ConfigError(
                f"{what}[{key!r}] is {got}; every value of a dict of inputs must be a tensor with the samples "
                "along dim 0. Fix a non-tensor setting in the model instead (its config, or a wrapper's forward)."
            )
        if first is None:
            first = key
        elif value.shape[0] != x[first].shape[0]:
            raise ConfigError(
                f"{what}[{key!r}] has {value.shape[0]} samples along dim 0 but {what}[{first!r}] has "
                f"{x[first].shape[0]}; every tensor of a dict of inputs must have the same batch size"
            )
    return dict(x)


class DataSource:
    """What ``train_dataset`` / ``evaluate`` / ``predict`` read; ``batches(...)`` yields ``(inputs, target)``."""

    num_samples: int | None  # None: unknown (an iterable loader)

    def batches(self, *, epoch: int, batch_size: int, shuffle: bool, seed: int, merge_last: bool,
                start: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

    def num_batches(self, batch_size: int, merge_last: bool) -> int | None:
        if self.num_samples is None:
            return None
        return len(_chunks(torch.arange(self.num_samples), batch_size, merge_last))


class TensorSource(DataSource):
    """Inputs (a tensor, a tuple or a dict of them) and targets indexed along dim 0."""

    def __init__(self, inputs: Inputs, target: torch.Tensor | None) -> None:
        if isinstance(inputs, dict):
            sizes = {num_samples_in(inputs)}  # _keywords checked every value
        else:
            sizes = {int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(sizes) != 1 or any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in inputs):
                raise ConfigError(
                    f"x must be a tensor (or a tuple of tensors) with the samples along dim 0; got "
                    f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in inputs]}"
                )
        self.num_samples: int = sizes.pop()
        if target is not None:
            if not isinstance(target, torch.Tensor) or target.dim() == 0:
                raise ConfigError(
                    f"y must be a tensor with one target per sample along dim 0, got {type(target).__name__}")
            if target.shape[0] != self.num_samples:
                raise ConfigError(
                    f"x has {self.num_samples} samples but y has {target.shape[0]}; they must match along dim 0"
                )
        if self.num_samples == 0:
            raise ConfigError("x has no samples (dim 0 is 0)")
        self.inputs, self.target = inputs, target

    def batches(self, *, epoch: int, batch_size: int, shuffle: bool, seed: int, merge_last: bool,
                start: int = 0) -> Iterator[Batch]:
        order = epoch_order(self.num_samples, epoch, seed, shuffle)
        for idx in _chunks(order, batch_size, merge_last)[start:]:
            yield tree_map(lambda t: t[idx], self.inputs), None if self.target is None else self.target[idx]


class DatasetSource(DataSource):
    """A map-style ``Dataset`` whose items are ``(x, y)``; batches collated with ``default_collate``."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        try:
            self.num_samples: int = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"{type(dataset).__name__} has no len(); pass a map-style Dataset or a DataLoader") from None
        if self.num_samples == 0:
            raise ConfigError(f"the dataset {type(dataset).__name__} is empty")
        self.dataset = dataset

    def batches(self, *, epoch: int, batch_size: int, shuffle: bool, seed: int, merge_last: bool,
                start: int = 0) -> Iterator[Batch]:
        order = epoch_order(self.num_samples, epoch, seed, shuffle)
        for idx in _chunks(order, batch_size, merge_last)[start:]:
            yield _split_item(default_collate([self.dataset[int(i)] for i in idx]))


def _split_item(batch: Any) -> Batch:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return _as_inputs(batch[0], "each batch's x"), batch[1]
    if isinstance(batch, torch.Tensor):
        return (batch,), None
    if isinstance(batch, Mapping):
        return _keywords(batch, "each batch's x"), None
    raise ConfigError(
        f"each dataset item / loader batch must be (x, y) (or x alone for predict), got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
    )


class LoaderSource(DataSource):
    """A ``DataLoader`` (or any iterable of ``(x, y)`` batches): its own order and batch size.
    With ``merge_last``, a batch smaller than the loader's first joins the one before."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        dataset = getattr(loader, "dataset", None)
        try:
            self.num_samples = None if isinstance(dataset, IterableDataset) or dataset is None else len(dataset)
        except TypeError:
            self.num_samples = None

    def batches(self, *, epoch: int, batch_size: int, shuffle: bool, seed: int, merge_last: bool,
                start: int = 0) -> Iterator[Batch]:
        held: Batch | None = None
        index, full = 0, None
        for raw in self.loader:
            batch = _split_item(raw)
            full = num_samples_in(batch[0]) if full is None else full
            if merge_last and held is not None and num_samples_in(batch[0]) < full:
                held = _concat(held, batch)  # a short (last) batch joins the one before
                continue
            if held is not None:
                if index >= start:
                    yield held
                index += 1
            held = batch
        if held is not None and index >= start:
            yield held

    def num_batches(self, batch_size: int, merge_last: bool) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None


def _concat(a: Batch, b: Batch) -> Batch:
    inputs = tree_map(lambda u, v: torch.cat([u, v]), a[0], b[0])
    target = None if a[1] is None else torch.cat([a[1], b[1]])
    return inputs, target


def make_source(x: Any, y: Any, *, need_target: bool) -> DataSource:
    """The right :class:`DataSource` for tensors, a ``Dataset`` or a ``DataLoader``."""
    if isinstance(x, (Dataset, DataLoader)) or (not isinstance(x, (torch.Tensor, tuple, list, Mapping))
                                                 and hasattr(x, "__iter__")):
        if y is not None:
            raise ConfigError(
                f"x is a {type(x).__name__}, which yields (x, y) pairs itself; pass y=None"
            )
        if isinstance(x, IterableDataset):
            return LoaderSource(DataLoader(x, batch_size=None))
        if isinstance(x, Dataset):
            return DatasetSource(x)
        return LoaderSource(x)
    if need_target and y is None:
        raise ConfigError("y is None: pass the targets (one per sample of x), or a Dataset / DataLoader of (x, y) as x")
    return TensorSource(_as_inputs(x), y)


def pad(inputs: Inputs, min_size: int) -> tuple[Inputs, int]:
    """Inputs grown to ``min_size`` samples by repeating the last (for inference only), and the real count."""
    n = num_samples_in(inputs)
    if n >= min_size:
        return inputs, n
    grown = tree_map(lambda t: torch.cat([t, t[-1:].expand(min_size - n, *t.shape[1:])]), inputs)
    return grown, n
