"""Compiled stages (replica/parallel/compile.py): the plain model's gradients, its names, no recompiles.

Every test but one compiles with ``backend="aot_eager"`` (the same dynamo graphs and AOTAutograd
joint graphs inductor gets, without its C++ build, which costs seconds per graph on a CPU).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import replica
from replica.errors import ConfigError
from replica.parallel.compile import compile_backend, compiled_stage, recompiles
from replica.partition.cost import fused_ops
from replica.partition.trace import trace
from replica.stage.weightgrad import WeightGrads, collecting
from tests.grads import assert_same_grads
from tests.models import mlp, tiny_gpt
from tests.train_cases import ACROSS_LAYOUTS, assert_same_weights, run, weights


def _reference(model, x, y, loss_fn):
    ref = copy.deepcopy(model)
    loss_fn(ref(*x), y).backward()
    return ref


@pytest.mark.parametrize("compile_", ["yes", 1, 0.0, "inductor"])
def test_compile_must_be_true_false_or_none(compile_) -> None:
    model, x, _, _ = mlp()
    with pytest.raises(ConfigError, match="compile must be True"):
        replica.plan(model, x, num_stages=2, compile=compile_)
    with pytest.raises(ConfigError, match="compile must be True"):
        replica.defaults.TrainerConfig(compile=compile_)


def test_the_trainer_config_plans_with_compile() -> None:
    assert replica.defaults.TrainerConfig(compile=True).planning()["compile"] is True


def test_a_compiled_trainer_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path, capsys) -> None:
    """compile=True through the Trainer: batches of 32, 32 and 36 (the last's micro-batches another
    size), a run dying after step 4 and one resuming from its checkpoint of step 4 (another model
    seed: every weight from the checkpoint) end with the uninterrupted compiled run's weights, and
    those are the eager run's. Priced analytically: each run plans alike (timed ops could move a cut)."""
    metrics = tmp_path / "metrics.jsonl"
    with compile_backend("aot_eager"):
        whole = run(None, compile=True, num_stages=2, model_seed=0,  # the seed the dying run starts from
                    metrics_file=str(metrics), progress=True, cost="analytic")
        assert all(compiled_stage(s.module) is not None for s in whole.pipeline.stages)
    # the warm-up's compile seconds, said once (step 1), none after (the uneven last batch: the batch dim dynamic)
    compiles = [e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "compile"]
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("replica: 1 process: ") and ", fp32, compiled; weights: " in said[0], said[0]
    assert said[1].startswith("compile: ") and " s in step 1, torch.compile's warm-up" in said[1], said[1]
    assert [(e["step"], e["first"]) for e in compiles] == [(1, True)] and compiles[0]["seconds"] > 0, compiles
    with compile_backend("aot_eager"):
        run(tmp_path, stop_at=4, compile=True, num_stages=2, cost="analytic")
        resumed = run(tmp_path, compile=True, num_stages=2, cost="analytic")
    assert resumed.resumed_from.name == "step-00000004" and resumed.step == whole.step == 9
    assert_same_weights(weights(resumed.model), weights(whole.model), rtol=0, atol=0)
    eager = run(None, compile=False, num_stages=2, model_seed=0, cost="analytic")
    # priced compiled, the plan grades its micro-batches in another order: fp32 round-off over 9 AdamW steps
    assert_same_weights(weights(whole.model), weights(eager.model), **ACROSS_LAYOUTS)


@pytest.mark.parametrize("factory,schedule,recompute,num_stages", [
    (tiny_gpt, "1f1b", False, 2), (tiny_gpt, "zb-h1", False, 2),
    # the other schedules on the MLP (what they change is the order of actions, not the graphs; a quarter of
    # the tiny GPT's compile time): two stages a pipeline rank, looped or in a V, W deferred in zero-bubble ones
    (mlp, "gpipe", False, 2), (mlp, "interleaved", False, 4), (mlp, "zb-v", False, 4),
    (mlp, "zb-interleaved", False, 4),
    (tiny_gpt, "1f1b", "selective", 2),  # each block's region compiled inside its checkpoint (as with True)
    (mlp, "1f1b", True, 2),  # no blocks: each stage checkpointed whole, its compiled forward inside the checkpoint
])
def test_compiled_stages_give_the_plain_models_gradients(factory, schedule, recompute, num_stages) -> None:
    model, x, y, loss_fn = factory(batch_size=8)
    ref = _reference(model, x, y, loss_fn)
    with compile_backend("aot_eager"):
        pm = replica.auto_parallel(model, x, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                                   recompute=recompute, loss_fn=loss_fn, compile=True)
    assert pm.plan.compile and all(compiled_stage(s.module) is not None for s in pm.stages)
    assert "compile: every stage through torch.compile" in pm.plan.summary()
    pm.train_step(x, y)
    assert_same_grads(pm, ref, rtol=1e-4, atol=1e-6)
    assert list(pm.state_dict()) == list(model.state_dict())  # original names, no _orig_mod
    for s in pm.stages:
        assert not any("_orig_mod" in name for name in s.module.state_dict())


def test_compiled_dropout_is_seeded_alike_across_schedules_and_recompute() -> None:
    """Compiled stages draw each micro-batch's dropout masks as eager ones do: the same loss and
    gradients under GPipe, 1F1B (checkpointed blocks replaying their masks; 'selective' replays the
    same way) and ZB-H1, and through
    aot_eager the eager run's. (Inductor draws its own numbers, alike across these schedules, checked
    by hand; ``torch._inductor.config.fallback_random`` draws eager's.)"""
    from tests.conftest import COMPUTE_BOUND
    from tests.test_inputs_modes import Masked, batch, grads, token_loss

    torch.manual_seed(0)
    model = Masked(p=0.3)
    ids, _, target = batch()
    results = []
    for compile_, schedule, recompute in [(False, "gpipe", False), (True, "gpipe", False), (True, "1f1b", True),
                                          (True, "zb-h1", False)]:
        model.zero_grad()
        with compile_backend("aot_eager"):
            pm = replica.auto_parallel(model, (ids,), num_stages=2, num_microbatches=4, schedule=schedule,
                                       recompute=recompute, loss_fn=token_loss, device=COMPUTE_BOUND, compile=compile_)
        assert any(s.uses_rng for s in pm.stages)
        torch.manual_seed(123)
        results.append((pm.train_step(ids, target), grads(model)))
    for loss, got in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for name, grad in got.items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_zero_bubble_stages_still_defer_their_weight_gradients() -> None:
    """A traced linear backward would read the weight-gradient sink at compile time (none):
    W would find nothing to do. The deferred linears stay eager, so B leaves them to W."""
    model, x, y, loss_fn = tiny_gpt(batch_size=4)
    with compile_backend("aot_eager"):
        pm = replica.auto_parallel(model, x, num_stages=2, num_microbatches=2, schedule="zb-h1", loss_fn=loss_fn,
                                   compile=True)
    first = pm.stages[0]
    assert compiled_stage(first.module).eager_linears > 0
    out = [o for o in first.module(x[0]) if isinstance(o, torch.Tensor) and o.requires_grad]
    sink = WeightGrads()
    with collecting(sink):
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    assert len(sink) == compiled_stage(first.module).eager_linears
    assert all(p.grad is None for n, p in first.module.named_parameters() if n.endswith("c_fc.weight"))
    sink.apply()
    assert all(p.grad is not None for n, p in first.module.named_parameters() if n.endswith("c_fc.weight"))


def test_uneven_and_graded_microbatches_compile_once() -> None:
    """The batch dim is dynamic from the first call: micro-batches of 3, 3, 2 and 2 samples
    compile each stage's graph once, and a later step of another batch size compiles nothing."""
    torch._dynamo.reset()
    model, x, y, loss_fn = tiny_gpt(batch_size=10)
    ref = _reference(model, x, y, loss_fn)
    with compile_backend("aot_eager"):
        pm = replica.auto_parallel(model, x, num_stages=2, num_microbatches=4, loss_fn=loss_fn, compile=True,
                                   graded_microbatches=False)
    before = recompiles()
    pm.train_step(x, y)
    first = recompiles() - before
    assert_same_grads(pm, ref, rtol=1e-4, atol=1e-6)
    assert first == len(pm.stages)  # one graph per stage, whatever the micro-batch sizes
    pm.train_step(x[0][:9], y[:9])  # another batch: micro-batches of 3, 2, 2 and 2 samples
    assert recompiles() - before == first  # (one of 1 sample would compile once more: dynamo specializes 0 and 1)


def test_compile_none_is_off_on_a_cpu_and_on_for_a_gpu() -> None:
    model, x, _, _ = tiny_gpt(batch_size=8)
    cpu = replica.plan(model, x, num_stages=2, device="cpu", cost="analytic")
    assert not cpu.compile and "compile: off (compile=None" in cpu.summary()
    with torch.device("meta"):
        big = copy.deepcopy(model).to("meta")
    gpu = replica.plan(big, tuple(t.to("meta") for t in x), num_stages=2, device="h100-80gb")
    assert gpu.compile and "compile=None on h100-80gb: on, priced" in gpu.summary()
    assert not replica.plan(model, x, num_stages=2, device="h100-80gb", cost="analytic").compile  # weights on CPU


def test_compile_none_on_a_gpu_takes_the_faster_of_the_same_layout_compiled_and_eager() -> None:
    """None never picks the slower of the two prices. A GPT's pointwise chains fuse (on at 8
    micro-batches); a compiled backward runs whole, so over 2 pipeline ranks at 2 micro-batches the
    early input-gradient sends it loses cost more (off); an MLP of linears and ReLUs has no chain
    to fuse (off)."""
    from examples.gpt.model import GPT, GPTConfig

    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=1024, block_size=256)
    with torch.device("meta"):
        gpt = GPT(config)
    x = torch.randint(0, config.vocab_size, (8, config.block_size), device="meta")
    net, features, _, _ = mlp(batch_size=64)
    net_inputs = tuple(t.to("meta") for t in features)
    choices = []
    for model, inputs, m in ((gpt, (x,), 8), (gpt, (x,), 2), (copy.deepcopy(net).to("meta"), net_inputs, 8)):
        world = dict(world_size=2, num_stages=2, schedule="1f1b", num_microbatches=m, device="h100-80gb")
        steps = {c: replica.plan(model, inputs, compile=c, **world).predicted_step_time_s for c in (False, True)}
        chosen = replica.plan(model, inputs, **world)
        assert chosen.predicted_step_time_s == pytest.approx(min(steps.values()), rel=1e-9)
        assert chosen.compile == (steps[False] / steps[True] > 1.01)
        assert f"compile=None on h100-80gb: {'on' if chosen.compile else 'off'}" in chosen.summary()
        choices.append(chosen.compile)
    assert choices == [True, False, False]
    # tensor-parallel stages compile too (static shapes): their chains fuse and DTensor's dispatch is
    # paid once, when traced, so the same rule holds
    world = dict(world_size=2, tensor_parallel_size=2, num_stages=1, schedule="1f1b", num_microbatches=8,
                 device="h100-80gb")
    steps = {c: replica.plan(gpt, (x,), compile=c, **world).predicted_step_time_s for c in (False, True)}
    tensor_parallel = replica.plan(gpt, (x,), **world)
    assert steps[False] / steps[True] > 1.01 and tensor_parallel.compile, steps
    assert tensor_parallel.predicted_step_time_s == pytest.approx(steps[True], rel=1e-9)
    assert "stages [0] compile each micro-batch size once (static shapes" in tensor_parallel.summary()
    assert tensor_parallel.static_shape_stages == (0,)
    assert replica.plan(gpt, (x,), **{**world, "world_size": 1, "tensor_parallel_size": 1}).static_shape_stages == ()


def test_compiled_plans_price_pointwise_chains_as_one_pass() -> None:
    model, x, _, _ = tiny_gpt(batch_size=8)
    graph = trace(model, x).graph
    fused = fused_ops(graph)
    assert fused and all(graph[name].target in ("add", "mul", "gelu", "masked_fill") for name in fused)
    eager = replica.plan(model, x, num_stages=2, device="h100-80gb", cost="analytic", compile=False)
    compiled = replica.plan(model, x, num_stages=2, device="h100-80gb", cost="analytic", compile=True)
    assert compiled.predicted_step_time_s < eager.predicted_step_time_s
    assert replica.Plan.from_json(compiled.to_json()).compile
    # across ranks a compiled backward runs whole: no input gradients sent before the weight gradients
    # (sending early keeps the linears eager between graphs: measured slower, benchmarks/RESULTS.md)
    world = dict(world_size=2, num_stages=2, schedule="1f1b", num_microbatches=4, cost="analytic")
    assert replica.plan(model, x, compile=False, **world).sends_input_grads_early
    assert not replica.plan(model, x, compile=True, **world).sends_input_grads_early


def test_a_given_plan_must_agree_on_compile() -> None:
    model, x, y, loss_fn = mlp()
    plan = replica.plan(model, x, num_stages=2, compile=False)
    with pytest.raises(ConfigError, match="compile=True disagrees"):
        replica.auto_parallel(model, x, plan=plan, loss_fn=loss_fn, compile=True)


def test_no_cpp_compiler_for_inductor_on_a_cpu_is_a_config_error(monkeypatch) -> None:
    """Inductor builds a CPU stage's kernels in C++ at the first step: with no compiler (a slim
    image) auto_parallel says so and what to do, instead of torch failing inside train_step."""
    from torch._inductor import cpp_builder, exc

    def no_compiler() -> str:
        raise exc.InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    model, x, _, loss_fn = mlp(batch_size=8)
    with pytest.raises(ConfigError, match=r"compile=True compiles 2 CPU stage\(s\) with inductor.*no working C\+\+ "
                                          r"compiler was found.*apt-get install g\+\+.*compile=False"):
        replica.auto_parallel(model, x, num_stages=2, loss_fn=loss_fn, compile=True)
    with compile_backend("aot_eager"):  # no C++ build: nothing to check
        assert replica.auto_parallel(model, x, num_stages=2, loss_fn=loss_fn, compile=True).plan.compile


@pytest.mark.slow
def test_inductor_stages_give_the_plain_models_gradients() -> None:
    """The one test through inductor itself (its C++ build: tens of seconds here)."""
    model, x, y, loss_fn = mlp(batch_size=8)
    ref = _reference(model, x, y, loss_fn)
    pm = replica.auto_parallel(model, x, num_stages=2, num_microbatches=2, loss_fn=loss_fn, compile=True)
    assert compiled_stage(pm.stages[0].module).backend == "inductor"
    pm.train_step(x, y)
    assert_same_grads(pm, ref, rtol=1e-4, atol=1e-6)


def test_compiled_plans_leave_rebuilds_to_the_compiler() -> None:
    """Rebuilt GELU / LayerNorm outputs go through autograd's saved-tensor hooks and a norm that
    notes its eps on its autograd node (a graph break): a compiled plan has none, and
    recompute='pointwise' with compile=True is refused."""
    model, x, _, _ = tiny_gpt(batch_size=8)
    plan = replica.plan(model, x, num_stages=2, compile=True)
    assert not plan.rebuilds and not plan.pointwise_recompute
    with pytest.raises(ConfigError, match="recompute='pointwise' rebuilds"):
        replica.plan(model, x, num_stages=2, compile=True, recompute="pointwise")


def test_float8_is_priced_for_an_h100_and_refused_elsewhere() -> None:
    model, x, _, _ = tiny_gpt(batch_size=8)
    with pytest.raises(ConfigError, match="needs an SM90 GPU"):
        replica.plan(model, x, num_stages=2, float8=True)  # a CPU
    with pytest.raises(ConfigError, match="needs an SM90 GPU"):
        replica.plan(model, x, num_stages=2, float8=True, device="a100-80gb", cost="analytic")
    with pytest.raises(ConfigError, match="Use compile=True or None with float8=True"):
        replica.plan(model, x, num_stages=2, float8=True, compile=False)
    with pytest.raises(ConfigError, match="float8 must be True"):
        replica.plan(model, x, num_stages=2, float8="yes")
    meta = copy.deepcopy(model).to("meta")
    inputs = tuple(t.to("meta") for t in x)
    compiled = replica.plan(meta, inputs, num_stages=2, device="h100-80gb", mixed_precision="bf16", compile=True)
    float8 = replica.plan(meta, inputs, num_stages=2, device="h100-80gb", mixed_precision="bf16", float8=True)
    assert float8.compile and float8.float8 and "the linears in float8" in float8.summary()
    assert float8.predicted_step_time_s < compiled.predicted_step_time_s
    with pytest.raises(ConfigError, match="this stage's weights are on the CPU"):
        from replica.parallel.float8 import float8_stage
        float8_stage(model)


def test_compiled_stages_run_under_the_plans_autocast() -> None:
    """bf16: the compiled graphs compute in autocast's dtypes, as the eager stages do (through
    aot_eager the same kernels: the same gradients, bit for bit)."""
    model, x, y, loss_fn = tiny_gpt(batch_size=8)
    eager = replica.auto_parallel(copy.deepcopy(model), x, num_stages=2, num_microbatches=4, loss_fn=loss_fn,
                                  mixed_precision="bf16", compile=False)
    with compile_backend("aot_eager"):
        pm = replica.auto_parallel(model, x, num_stages=2, num_microbatches=4, loss_fn=loss_fn,
                                   mixed_precision="bf16", compile=True)
    eager.train_step(x, y)
    pm.train_step(x, y)
    assert_same_grads(pm, eager, rtol=0, atol=0)
