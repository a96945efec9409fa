"""Batch norm across micro-batches (``replica.stage.batchnorm``): running statistics of the
whole batch, updated once a step; gradients those of the plain model on each micro-batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replica
from replica.errors import PipelineError
from replica.runtime import microbatch
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


def case(batch: int = 16, *, cumulative: bool = True) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (``cumulative``: its head's norm keeps a cumulative average, momentum=None,
    which torch.export cannot trace), a batch, class targets."""
    return models.TinyResNet(cumulative=cumulative), torch.randn(batch, 3, 8, 8) * 2 + 0.5, torch.randint(0, 10, (batch,))


def statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def plain_on_micro_batches(model: nn.Module, x: torch.Tensor, y: torch.Tensor, plan: replica.Plan) -> nn.Module:
    """The plain model's gradients with each micro-batch normalized on its own (the mean loss of
    the whole batch), and the running statistics each batch norm keeps when it sees its whole
    batch of inputs at once: every micro-batch's, concatenated. For the first norm these are
    the plain model's on the whole batch; a later one's inputs come from layers that normalized
    per micro-batch, in the pipeline as in this reference."""
    grads = copy.deepcopy(model)
    norms = {name: m for name, m in grads.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    before = {name: copy.deepcopy(m) for name, m in norms.items()}
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in norms}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(args[0].detach()))
             for name, m in norms.items()]
    sizes = microbatch.sizes(x.shape[0], plan.num_microbatches, plan.microbatch_shares)
    for xs, ys in zip(x.split(sizes), y.split(sizes)):
        (F.cross_entropy(grads(xs), ys) * len(xs) / len(x)).backward()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for name, norm in before.items():
            norm(torch.cat(seen[name]))  # torch's own update, once, on the whole batch
            norms[name].load_state_dict(norm.state_dict())
    return grads


def check_one_step(pm: replica.PipelineModel, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   steps: int = 1) -> None:
    ref = copy.deepcopy(model)
    whole = copy.deepcopy(model)
    for _ in range(steps):
        want = plain_on_micro_batches(ref, x, y, pm.plan)
        ref.load_state_dict(statistics(want), strict=False)
        with torch.no_grad():
            whole(x)
        pm.zero_grad()
        pm.train_step((x,), y)
    torch.testing.assert_close(statistics(pm.model), statistics(want))
    first = {k: v for k, v in statistics(whole).items() if k.startswith("bn.")}
    torch.testing.assert_close({k: statistics(pm.model)[k] for k in first}, first)  # the plain model's
    assert_same_grads(pm, want)


def pipeline(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> replica.PipelineModel:
    kwargs = {"num_stages": 2, "device": COMPUTE_BOUND, **kwargs}
    return replica.auto_parallel(model, (x,), loss_fn=F.cross_entropy, **kwargs)


@pytest.mark.parametrize("num_microbatches", [2, 4])
@pytest.mark.parametrize("schedule,num_stages", [("1f1b", 2), ("gpipe", 3), ("interleaved", 4)])
def test_running_statistics_are_the_whole_batch_s(num_microbatches: int, schedule: str, num_stages: int) -> None:
    model, x, y = case()
    pm = pipeline(model, x, num_microbatches=num_microbatches, schedule=schedule, num_stages=num_stages)
    check_one_step(pm, copy.deepcopy(model), x, y)
    assert int(pm.model.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_recompute_counts_each_micro_batch_once(tracer: str) -> None:
    model, x, y = case(cumulative=tracer == "fx")
    pm = pipeline(model, x, num_microbatches=4, recompute=True, tracer=tracer)
    assert pm.plan.recompute
    check_one_step(pm, copy.deepcopy(model), x, y)


def test_exported_batch_norm_is_deferred_too() -> None:
    model, x, y = case(cumulative=False)
    pm = pipeline(model, x, num_microbatches=4, tracer="export")
    check_one_step(pm, copy.deepcopy(model), x, y, steps=2)
    assert int(pm.model.bn.num_batches_tracked) == 2


def test_several_steps_and_a_forward_in_training_mode() -> None:
    model, x, y = case()
    pm = pipeline(model, x, num_microbatches=4)
    check_one_step(pm, copy.deepcopy(model), x, y, steps=3)
    want = plain_on_micro_batches(pm.model, x, y, pm.plan)
    with torch.no_grad():
        pm(x)  # a pipelined forward in training mode: one update too
    torch.testing.assert_close(statistics(pm.model), statistics(want))
    assert int(pm.model.bn.num_batches_tracked) == 4


def test_eval_mode_uses_the_running_statistics() -> None:
    model, x, y = case()
    pm = pipeline(model, x, num_microbatches=4)
    pm.train_step((x,), y)
    pm.eval()
    before = {k: v.clone() for k, v in statistics(pm.model).items()}
    with torch.no_grad():
        torch.testing.assert_close(pm(x), pm.model(x))
    assert all(torch.equal(before[k], v) for k, v in statistics(pm.model).items())


def test_one_sample_micro_batches_name_the_fix() -> None:
    model, x, y = case(batch=4)
    pm = pipeline(model, x, num_microbatches=4)
    with pytest.raises(PipelineError, match=r"micro-batch of shape \(1, 16\).*fewer micro-batches"):
        pm.train_step((x,), y)


def test_one_micro_batch_is_the_plain_model() -> None:
    model, x, y = case()
    pm = pipeline(model, x, num_microbatches=1)
    check_one_step(pm, copy.deepcopy(model), x, y)


def _distributed_step(rank: int, world_size: int, recompute: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, x, y = case()
    pm = pipeline(model, x, num_microbatches=4, recompute=recompute, timeout_s=30, schedule="1f1b")
    pm.train_step((x,), y)
    return {k: v.clone() for k, v in statistics(pm.model).items() if k in pm.state_dict()}


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", [False, True])
def test_distributed_ranks_keep_the_whole_batch_s_statistics(recompute: bool) -> None:
    from replica.launch import run_local

    torch.manual_seed(0)
    model, x, y = case()
    pm = pipeline(copy.deepcopy(model), x, num_microbatches=4, recompute=recompute, schedule="1f1b")  # the ranks'
    want = statistics(plain_on_micro_batches(model, x, y, pm.plan))
    ranks = run_local(_distributed_step, 2, recompute, timeout_s=90)
    assert ranks[0] and ranks[1] and not ranks[0].keys() & ranks[1].keys()
    got = {**ranks[0], **ranks[1]}
    torch.testing.assert_close(got, want)


def test_deferred_batchnorm_can_be_turned_off():
    """``deferred_batchnorm=False``: each micro-batch updates the running statistics, as a
    micro-batched pipeline without it does (4 updates a step); a non-bool is refused."""
    model, x, y = case(16, cumulative=False)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=4, loss_fn=F.cross_entropy,
                               device=COMPUTE_BOUND, deferred_batchnorm=False)
    pm.train_step(x, y)
    assert int(model.bn.num_batches_tracked) == 4
    with pytest.raises(replica.ConfigError, match="deferred_batchnorm must be True or False, got 'yes'"):
        replica.auto_parallel(model, (x,), num_stages=2, loss_fn=F.cross_entropy, deferred_batchnorm="yes")
