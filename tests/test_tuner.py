"""The auto-tuner: configurations priced by simulation, memory respected, infeasible worlds explained."""

from __future__ import annotations

import dataclasses
import resource

import pytest
import torch

import replica
from benchmarks.plan_175b import plan_175b
from examples.gpt.model import GPTConfig
from replica.layout import TUNED_SCHEDULES as SCHEDULE_CHOICES
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


def test_the_tuner_fills_the_world():
    model, inputs, _, _ = models.tiny_gpt(16)
    p = replica.plan(model, inputs, world_size=4, device=COMPUTE_BOUND, schedule="auto")
    assert p.layout.world_size == 4
    assert p.schedule in SCHEDULE_CHOICES
    assert p.predicted_step_time_s > 0 and 0 <= p.bubble_fraction < 1


def test_the_choice_is_the_fastest_of_its_alternatives():
    model, inputs, _, _ = models.tiny_gpt(16)
    p = replica.plan(model, inputs, world_size=4, device=COMPUTE_BOUND, schedule="auto")
    assert p.alternatives and all(p.predicted_step_time_s <= t * 1.05 for _, t in p.alternatives)


def test_fixed_stages_leave_micro_batches_to_the_tuner():
    model, inputs, _, _ = models.tiny_gpt(16)
    p = replica.plan(model, inputs, world_size=2, num_stages=2, device=COMPUTE_BOUND)
    assert p.num_stages == 2 and p.data_parallel_size == 1 and p.num_microbatches >= 2


def test_a_tight_budget_turns_recompute_on():
    model, inputs, _, _ = models.tiny_gpt(64, num_layers=4)
    loose = replica.plan(model, inputs, world_size=2, num_stages=2, device=COMPUTE_BOUND, schedule="gpipe")
    fullest = max(s.predicted_memory_bytes for s in loose.stages)
    statics = max(s.memory.parameters + s.memory.gradients + s.memory.optimizer for s in loose.stages)
    tight = replica.plan(model, inputs, world_size=2, num_stages=2, device=COMPUTE_BOUND, schedule="gpipe",
                         memory_budget=(fullest + statics) / 2)
    assert tight.recompute and not loose.recompute


def test_the_tuned_plan_trains_exactly():
    model, inputs, target, loss_fn = models.tiny_gpt(8)
    ref = __import__("copy").deepcopy(model)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, inputs, num_stages=2, schedule="auto", loss_fn=loss_fn, device=COMPUTE_BOUND)
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss.detach())
    assert_same_grads(pm, ref)


def test_gpt3_175b_plans_on_1024_a100s():
    # 1F1B, full recompute (Megatron's), no sequence parallelism: the search over every schedule, recompute
    # mode and SP (the benchmark's, benchmarks/plan_175b.py) takes minutes on a 2-core machine; the smaller
    # tests here and in test_activation_checkpoint / test_sequence_parallel search those
    plan = plan_175b(1024, schedule="1f1b", recompute=True, sequence_parallel=False)
    assert max(s.predicted_memory_bytes for s in plan.stages) <= 80 * 2**30
    assert plan.layout.world_size == 1024
    assert plan.model_flops > 0 and "TFLOP/s per device" in plan.summary()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20  # KiB: under 4 GiB, no weights


def test_gpt3_175b_on_8_gpus_says_how_many_are_needed():
    # where nothing fits every candidate is simulated (no bound prunes): one schedule, recompute mode and
    # SP setting prove the error
    with pytest.raises(replica.PartitionError, match=r"About \d+ devices are needed") as err:
        plan_175b(8, schedule="1f1b", recompute=True, sequence_parallel=False)
    needed = int(str(err.value).split("About ")[1].split()[0])
    assert needed >= 32  # 175B x 16 bytes of weights, gradients and Adam state alone need 35 GPUs


def test_a_small_world_for_a_small_model_on_meta():
    with torch.device("meta"):
        from examples.gpt.model import GPT

        model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=64))
    tokens = torch.empty(32, 64, dtype=torch.long, device="meta")
    p = replica.plan(model, (tokens,), world_size=8, device="h100-80gb", schedule="auto")
    assert p.device == "h100-80gb" and p.num_stages >= 1


def test_one_stage_may_split_its_batch():
    from replica.planner.tuner import _microbatch_choices

    assert _microbatch_choices(32, 1, None, 1) == [1, 2, 4, 8]
    assert _microbatch_choices(3, 1, None, 1) == [1, 2]
    assert _microbatch_choices(32, 1, 4, 1) == [4]


def test_data_parallel_micro_batches_follow_the_cache():
    """Pure data parallelism splits its batch where that brings every op's tensors into the
    cache: memory-bound prices, each replica half the batch, a cache a quarter of the
    biggest op's bytes (so it fits from 2 micro-batches on), and launches that make each
    extra call about 3% of the step, more than a tie."""
    from replica.partition.trace import trace

    model, inputs, _, _ = models.tiny_gpt(16)
    graph = trace(model, inputs).graph
    biggest = max(n.bytes_accessed for n in graph.op_nodes)
    memory_bound = replica.DeviceSpec(name="memory-bound", flops=1e15, half_flops=1e15, memory_bandwidth=1e8,
                                      memory_bytes=1e12, link_bandwidth=1e12, link_latency_s=0.0,
                                      op_overhead_s=1e-9)

    def plan(spec: replica.DeviceSpec, **hints) -> replica.Plan:
        return replica.plan(model, inputs, world_size=2, num_stages=1, device=spec, cost="analytic",
                            **({"schedule": "auto"} | hints))

    step = plan(memory_bound, schedule="1f1b", num_microbatches=1).predicted_step_time_s
    launches = dataclasses.replace(memory_bound, op_overhead_s=step / (3 * len(graph.op_nodes) * 30))
    cached = dataclasses.replace(launches, name="cached", cache_bytes=biggest / 4, cache_bandwidth=1e10)
    assert plan(launches).num_microbatches == 1  # more calls, nothing gained
    assert plan(cached).num_microbatches == 2  # the fewest calls that fit
    assert plan(cached).predicted_step_time_s < plan(cached, schedule="1f1b", num_microbatches=1).predicted_step_time_s
    # with launches next to free, 2, 4 and 8 micro-batches tie: the one holding least wins
    free = dataclasses.replace(cached, op_overhead_s=1e-12)
    assert plan(free).num_microbatches == 8
