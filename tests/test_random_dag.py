"""Transparency on random DAGs: every cut, schedule and micro-batch count keeps the model's gradients."""

from __future__ import annotations

import copy

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import replica
from replica.partition.trace import trace
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

MAX_STAGES = 6


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    num_nodes=st.integers(1, 24),
    stages=st.integers(1, MAX_STAGES),
    num_microbatches=st.integers(1, 4),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
)
@example(seed=0, num_nodes=12, stages=4, num_microbatches=4, schedule="1f1b")
@example(seed=11, num_nodes=24, stages=6, num_microbatches=3, schedule="gpipe")
@example(seed=5, num_nodes=2, stages=6, num_microbatches=4, schedule="1f1b")
def test_random_dag_matches_the_plain_model(seed, num_nodes, stages, num_microbatches, schedule):
    model, inputs, target, loss_fn = models.random_dag(seed, num_nodes)
    num_stages = min(stages, len(trace(model, inputs).graph.op_nodes))  # every stage needs an op
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()

    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=num_microbatches,
                               schedule=schedule, loss_fn=loss_fn, device=COMPUTE_BOUND)
    assert pm.plan.num_stages == num_stages
    loss = pm.train_step(inputs, target)

    torch.testing.assert_close(loss, ref_loss.detach())
    want = dict(ref.named_parameters())
    assert dict(pm.named_parameters()).keys() == want.keys()
    assert_same_grads(model, want)
    with torch.no_grad():
        torch.testing.assert_close(pm(*inputs), ref(*inputs))
