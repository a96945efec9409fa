"""Trainer batches: a seeded order per epoch, layout-independent boundaries, a partial last batch merged."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replica
from replica.train.data import epoch_order, make_source, num_samples_in, pad


def sizes(source, **kw) -> list[int]:
    args = dict(epoch=0, batch_size=32, shuffle=False, seed=0, merge_last=True) | kw
    return [num_samples_in(b[0]) for b in source.batches(**args)]


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    a = epoch_order(100, epoch=3, seed=7, shuffle=True)
    assert torch.equal(a, epoch_order(100, epoch=3, seed=7, shuffle=True))
    assert sorted(a.tolist()) == list(range(100))
    assert not torch.equal(a, epoch_order(100, epoch=4, seed=7, shuffle=True))
    assert not torch.equal(a, epoch_order(100, epoch=3, seed=8, shuffle=True))
    assert torch.equal(epoch_order(5, epoch=3, seed=7, shuffle=False), torch.arange(5))


@pytest.mark.parametrize(("n", "merged", "kept"), [
    (70, [32, 38], [32, 32, 6]),   # a partial last batch joins the one before
    (64, [32, 32], [32, 32]),      # nothing partial
    (20, [20], [20]),              # the only batch stays, whatever its size
])
def test_a_partial_last_batch_is_merged_for_training(n: int, merged: list[int], kept: list[int]) -> None:
    source = make_source(torch.randn(n, 3), torch.arange(n), need_target=True)
    assert sizes(source) == merged
    assert sizes(source, merge_last=False) == kept
    assert source.num_batches(32, True) == len(merged)


def test_resuming_skips_whole_batches_of_the_same_order() -> None:
    x = torch.arange(100).float().unsqueeze(1)
    source = make_source(x, torch.arange(100), need_target=True)
    args = dict(epoch=2, batch_size=16, shuffle=True, seed=5, merge_last=True)
    every = list(source.batches(**args))
    rest = list(source.batches(**args, start=3))
    assert len(rest) == len(every) - 3
    for (xa, ya), (xb, yb) in zip(every[3:], rest):
        assert torch.equal(xa[0], xb[0]) and torch.equal(ya, yb)


def test_a_dataset_gives_the_batches_tensors_give() -> None:
    x, y = torch.randn(50, 4), torch.randint(0, 3, (50,))
    args = dict(epoch=1, batch_size=8, shuffle=True, seed=0, merge_last=True)
    for (xa, ya), (xb, yb) in zip(make_source(x, y, need_target=True).batches(**args),
                                  make_source(TensorDataset(x, y), None, need_target=True).batches(**args)):
        assert torch.equal(xa[0], xb[0]) and torch.equal(ya, yb)


def test_a_loader_keeps_its_order_and_its_short_last_batch_is_merged() -> None:
    x, y = torch.arange(70).float().unsqueeze(1), torch.arange(70)
    source = make_source(DataLoader(TensorDataset(x, y), batch_size=32), None, need_target=True)
    assert sizes(source) == [32, 38]
    assert sizes(source, merge_last=False) == [32, 32, 6]
    (xa, _), (xb, yb) = source.batches(epoch=0, batch_size=0, shuffle=True, seed=0, merge_last=True)
    assert torch.equal(yb, torch.arange(32, 70))
    assert sizes(source, start=1) == [38]


def test_pad() -> None:
    grown, n = pad((torch.arange(3),), 5)
    assert n == 3 and grown[0].tolist() == [0, 1, 2, 2, 2]
    same, n = pad((torch.arange(6),), 5)
    assert n == 6 and same[0].shape[0] == 6


@pytest.mark.parametrize(("x", "y", "says"), [
    (torch.randn(10, 3), torch.arange(9), "x has 10 samples but y has 9"),
    (torch.randn(10, 3), None, "y is None"),
    (TensorDataset(torch.randn(4, 2), torch.arange(4)), torch.arange(4), "pass y=None"),
    (torch.randn(0, 3), torch.arange(0), "no samples"),
    (torch.tensor(3.0), torch.arange(1), "samples along dim 0"),
    ({"ids": torch.zeros(10, 3), "mask": torch.ones(9, 3)}, torch.arange(10),
     r"x\['mask'\] has 9 samples along dim 0 but x\['ids'\] has 10"),
    ({"ids": torch.zeros(10, 3), "use_cache": False}, torch.arange(10), r"x\['use_cache'\] is a bool"),
    ({"ids": torch.zeros(10, 3), "scale": torch.tensor(2.0)}, torch.arange(10), r"x\['scale'\] is a 0-dim tensor"),
    ({}, torch.arange(10), "x is an empty dict"),
    ({"ids": torch.zeros(10, 3)}, torch.arange(9), "x has 10 samples but y has 9"),
])
def test_bad_data_raises_config_error(x, y, says: str) -> None:
    with pytest.raises(replica.ConfigError, match=says):
        make_source(x, y, need_target=True)


# --- keyword inputs: a dict of tensors batches and pads as a tuple does ----------------

def keywords(num_samples: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(num_samples * 2).view(num_samples, 2), "mask": torch.arange(num_samples).float()}


class Items(torch.utils.data.Dataset):
    def __init__(self, x: dict[str, torch.Tensor], y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return {key: t[i] for key, t in self.x.items()}, self.y[i]


def test_a_dict_batches_like_the_tuple_of_its_values_and_a_dataset_of_dicts_alike() -> None:
    x, y = keywords(50), torch.arange(50)
    args = dict(epoch=1, batch_size=8, shuffle=True, seed=0, merge_last=True)
    tuples = list(make_source(tuple(x.values()), y, need_target=True).batches(**args))
    dicts = list(make_source(x, y, need_target=True).batches(**args))
    items = list(make_source(Items(x, y), None, need_target=True).batches(**args))
    assert len(dicts) == len(items) == len(tuples) == 6  # 5 of 8, then 8 + 2
    for (xt, yt), (xd, yd), (xi, yi) in zip(tuples, dicts, items):
        assert list(xd) == list(xi) == ["ids", "mask"]
        assert all(torch.equal(xd[k], t) and torch.equal(xi[k], t) for k, t in zip(xd, xt))
        assert torch.equal(yd, yt) and torch.equal(yi, yt)


def test_a_loader_of_dicts_merges_its_short_last_batch_and_skips_on_resume() -> None:
    x, y = keywords(70), torch.arange(70)
    source = make_source(DataLoader(Items(x, y), batch_size=32), None, need_target=True)
    assert sizes(source) == [32, 38] and sizes(source, merge_last=False) == [32, 32, 6]
    ((xb, yb),) = source.batches(epoch=0, batch_size=0, shuffle=False, seed=0, merge_last=True, start=1)
    assert torch.equal(xb["ids"], x["ids"][32:]) and torch.equal(xb["mask"], x["mask"][32:])
    assert torch.equal(yb, y[32:])
    alone = make_source(DataLoader([{"ids": torch.zeros(2)}] * 5, batch_size=4), None, need_target=False)
    assert [(num_samples_in(xa), ya) for xa, ya in alone.batches(
        epoch=0, batch_size=0, shuffle=False, seed=0, merge_last=False)] == [(4, None), (1, None)]  # for predict


def test_pad_a_dict() -> None:
    x = keywords(10)
    grown, n = pad(keywords(3), 5)
    assert n == 3 and grown["mask"].tolist() == [0, 1, 2, 2, 2] and grown["ids"][-1].tolist() == [4, 5]
    same, n = pad(x, 5)
    assert n == 10 and same is x


def test_a_loader_whose_dict_batches_disagree_names_the_key() -> None:
    def collate(items):
        return {"ids": torch.zeros(len(items), 2), "mask": torch.zeros(len(items) + 1)}, torch.zeros(len(items))

    source = make_source(DataLoader(list(range(8)), batch_size=4, collate_fn=collate), None, need_target=True)
    with pytest.raises(replica.ConfigError, match=r"each batch's x\['mask'\] has 5 samples along dim 0 but "
                                                  r"each batch's x\['ids'\] has 4"):
        next(source.batches(epoch=0, batch_size=0, shuffle=False, seed=0, merge_last=True))
