"""Tests of micro-batch manipulation (``replica.runtime.microbatch``)."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.runtime import microbatch


def sizes(mbs, index=0):
    return [int(mb[index].shape[0]) for mb in mbs]


# --------------------------------------------------------------------------- batch size


def test_batch_size():
    assert microbatch.batch_size([torch.zeros(5, 2), torch.zeros(5)]) == 5


def test_batch_size_ignores_scalars_and_non_tensors():
    assert microbatch.batch_size([torch.zeros(3, 2), torch.tensor(1.0), "x", 7]) == 3


def test_batch_size_nested():
    assert microbatch.batch_size([(torch.zeros(4), {"a": torch.zeros(4, 1)})]) == 4


def test_batch_size_mismatch_names_both_sizes():
    with pytest.raises(replica.ConfigError, match=r"disagree on the batch size \(dim 0\): \[6, 8\]"):
        microbatch.batch_size([torch.zeros(8, 2), torch.zeros(6, 2)])


def test_batch_size_mismatch_nested():
    with pytest.raises(replica.ConfigError, match=r"\[3, 4\]"):
        microbatch.batch_size([torch.zeros(4), {"a": [torch.zeros(3)]}])


def test_batch_size_names_what():
    with pytest.raises(replica.ConfigError, match="^target disagree"):
        microbatch.batch_size([torch.zeros(8), torch.zeros(6)], "target")


def test_no_batched_tensor():
    with pytest.raises(replica.ConfigError, match="no tensor with a batch dimension"):
        microbatch.batch_size([torch.tensor(3.0), 4])


# --------------------------------------------------------------------------- split


def test_even_split():
    assert sizes(microbatch.split([torch.zeros(8, 3)], 4)) == [2, 2, 2, 2]


def test_uneven_split_8_into_3():
    assert sizes(microbatch.split([torch.zeros(8, 3)], 3)) == [3, 3, 2]


@pytest.mark.parametrize("n, m", [(7, 2), (10, 4), (5, 5), (9, 1), (13, 6)])
def test_uneven_sizes_differ_by_at_most_one(n, m):
    got = sizes(microbatch.split([torch.zeros(n)], m))
    assert sum(got) == n and len(got) == m and max(got) - min(got) <= 1


def test_split_keeps_order():
    x = torch.arange(8)
    assert torch.equal(torch.cat([mb[0] for mb in microbatch.split([x], 3)]), x)


def test_split_gives_views():
    x = torch.zeros(6, 2)
    first = microbatch.split([x], 2)[0][0]
    assert first.data_ptr() == x.data_ptr()


def test_split_tuple_of_inputs():
    a, b = torch.arange(6), torch.arange(6) * 10
    mbs = microbatch.split([a, b], 3)
    assert len(mbs) == 3 and all(len(mb) == 2 for mb in mbs)
    assert torch.equal(mbs[1][1], torch.tensor([20, 30]))


def test_split_nested_structures():
    x = torch.arange(4)
    mbs = microbatch.split([(x, {"a": x * 2, "b": [x * 3]})], 2)
    second = mbs[1][0]
    assert isinstance(second, tuple) and set(second[1]) == {"a", "b"}
    assert torch.equal(second[1]["a"], torch.tensor([4, 6]))
    assert torch.equal(second[1]["b"][0], torch.tensor([6, 9]))


def test_non_tensors_replicated():
    mbs = microbatch.split([torch.zeros(4), 3, "mode", None], 2)
    assert all(mb[1:] == (3, "mode", None) for mb in mbs)


def test_zero_dim_tensors_replicated():
    t = torch.tensor(0.5)
    mbs = microbatch.split([torch.zeros(4), t], 4)
    assert all(mb[1] is t for mb in mbs)


def test_split_returns_tuples():
    assert all(type(mb) is tuple for mb in microbatch.split([torch.zeros(4)], 2))


def test_split_mismatched_batch_sizes():
    with pytest.raises(replica.ConfigError) as info:
        microbatch.split([torch.zeros(8), torch.zeros(6)], 2)
    assert "6" in str(info.value) and "8" in str(info.value)


def test_too_many_microbatches_names_both_numbers():
    with pytest.raises(replica.ConfigError, match=r"num_microbatches=5 but the inputs have a batch of 3.*<= 3"):
        microbatch.split([torch.zeros(3)], 5)


@pytest.mark.parametrize("m", [0, -1])
def test_non_positive_microbatches(m):
    with pytest.raises(replica.ConfigError, match=f"num_microbatches={m}"):
        microbatch.split([torch.zeros(3)], m)


def test_split_names_what():
    with pytest.raises(replica.ConfigError, match="the target have a batch of 2"):
        microbatch.split([torch.zeros(2)], 3, "target")


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        microbatch.split([torch.zeros(2)], 3)


# --------------------------------------------------------------------------- loss weights


def test_loss_weights_mean_even():
    assert microbatch.loss_weights(microbatch.split([torch.zeros(8)], 4), "mean") == [0.25] * 4


def test_loss_weights_mean_uneven():
    assert microbatch.loss_weights(microbatch.split([torch.zeros(8)], 3), "mean") == [3 / 8, 3 / 8, 2 / 8]


def test_loss_weights_sum():
    assert microbatch.loss_weights(microbatch.split([torch.zeros(8)], 3), "sum") == [1.0, 1.0, 1.0]


def test_loss_weights_mean_add_up_to_the_batch_mean():
    x = torch.randn(7, 3)
    mbs = microbatch.split([x], 3)
    weights = microbatch.loss_weights(mbs, "mean")
    total = sum(w * mb[0].pow(2).mean() for w, mb in zip(weights, mbs))
    torch.testing.assert_close(total, x.pow(2).mean())


def test_loss_weights_sum_add_up_to_the_batch_sum():
    x = torch.randn(7, 3)
    mbs = microbatch.split([x], 3)
    total = sum(w * mb[0].sum() for w, mb in zip(microbatch.loss_weights(mbs, "sum"), mbs))
    torch.testing.assert_close(total, x.sum())


# --------------------------------------------------------------------------- merge


def test_merge_round_trips_split():
    x = torch.randn(8, 3)
    torch.testing.assert_close(microbatch.merge([mb[0] for mb in microbatch.split([x], 3)]), x)


def test_merge_round_trips_nested_split():
    x = torch.randn(5, 2)
    value = (x, {"a": x + 1})
    merged = microbatch.merge([mb[0] for mb in microbatch.split([value], 2)])
    torch.testing.assert_close(merged[0], x)
    torch.testing.assert_close(merged[1]["a"], x + 1)


def test_merge_dict_output():
    merged = microbatch.merge([{"y": torch.ones(2)}, {"y": torch.zeros(1)}])
    assert list(merged) == ["y"] and torch.equal(merged["y"], torch.tensor([1.0, 1.0, 0.0]))


def test_merge_keeps_non_tensors_from_the_first():
    assert microbatch.merge([(torch.ones(1), 3), (torch.ones(1), 3)])[1] == 3


def test_merge_one_is_identity():
    out = (torch.tensor(2.0), "x")
    assert microbatch.merge([out]) is out


def test_merge_zero_dim_raises():
    with pytest.raises(replica.ConfigError, match="0-dim tensor.*num_microbatches=1"):
        microbatch.merge([torch.tensor(1.0), torch.tensor(2.0)])


def test_merge_keeps_autograd():
    x = torch.randn(4, 2, requires_grad=True)
    merged = microbatch.merge([mb[0] * 2 for mb in microbatch.split([x], 2)])
    merged.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 2), 2.0))
