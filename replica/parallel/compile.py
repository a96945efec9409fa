"""Compilation of a stage: its fx graph handed to ``torch.compile``, the batch dimension dynamic.

The parallelize step calls :func:`compile_stage` on each stage this process runs, after the
stage rewrites and activation checkpointing and before FSDP2, as torchtitan's ``apply_compile``
sits between activation checkpointing and ``fully_shard``. A stage is already an
``fx.GraphModule``, so its ``forward`` is compiled as it is; the module keeps its class, its
parameters and their original names (no ``_orig_mod``), and hooks on it (FSDP2's root unit, the
last stage's output unflattening) stay outside the compiled code.

- **Shapes.** Every tensor a stage receives has its first dimension marked dynamic
  (``maybe_mark_dynamic``) before each call: graded micro-batches and the last uneven one change
  it, and a dim compiled static would recompile on each new size.
- **Checkpointed blocks.** Each block's region (:mod:`replica.stage.checkpoint`) is compiled by
  itself and run inside its eager ``torch.utils.checkpoint``: dynamo traces a checkpoint only
  with a selective policy's ``context_fn``, not the batch-norm recompute context every region
  carries. The stage's graph breaks around each region.
- **Zero-bubble stages.** A stage whose linears defer their weight gradients
  (:mod:`replica.stage.weightgrad`) keeps those linears eager (``torch._dynamo.disable``): traced,
  their backward would read the weight-gradient sink once, at compile time, and the W actions
  would find nothing to do. The graph breaks at each of them; the ops between them compile.
- **FSDP2.** Its root unit's hooks sit on the stage module, outside the compiled forward; its
  per-block units hook the leaf modules the stage graph calls (:mod:`replica.parallel.fsdp`), so
  dynamo runs those hooks eagerly and the graph breaks at each unit (17 graphs for the example
  GPT's one zero3 stage, benchmarks/compile.py). Gradients are exact either way.
- **Tensor parallelism.** A stage holding tensor-parallel blocks compiles with DTensor traced
  (the compiled graph holds the local ops and functional collectives DTensor dispatched to, once),
  Replica's split of a fused q/k/v output included (:func:`replica.parallel.tensor_parallel.split`
  compares placements whole, which dynamo traces). Its shapes are static (``static``): one graph
  per micro-batch size, compiled in the warm-up. A symbolic batch fails in DTensor's view rules
  (torch 2.13: a matmul flattening the batch with the heads cut over the group asks for a
  ``_StridedShard`` of symbolic split factor).
- **Expert parallelism.** Each expert-parallel layer (:class:`replica.parallel.experts.ExpertParallel`)
  runs eagerly between compiled graphs: its all-to-all's sizes are the routing's, read as Python
  ints (a graph per routing otherwise). The router before it and the ops after it compile.
- **Backend.** ``"inductor"`` unless :func:`compile_backend` names another for the stages made
  inside it (the tests use ``"aot_eager"``: inductor's C++ build costs seconds per graph on a CPU).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from replica.errors import ConfigError
from replica.partition.plan import Plan
from replica.scoped import Scoped
from replica.stage import weightgrad
from replica.stage.checkpoint import CHECKPOINTED

__all__ = ["compile_stage", "compile_backend", "compile_seconds", "check_cpu_compiler", "inductor_cache_dir",
           "recompiles", "CompiledStage", "compiled_stage", "runs_eagerly"]

_backend: Scoped[str] = Scoped("inductor")
_COMPILED = "replica_compiled"  # the module attribute that holds its CompiledStage


@contextmanager
def compile_backend(name: str) -> Iterator[None]:
    """Stages compiled inside this block use ``torch.compile``'s backend ``name`` (e.g.
    ``"aot_eager"``: the same graphs through AOTAutograd without inductor's code generation)."""
    with _backend.using(name):
        yield


class CompiledStage:
    """A stage's compiled forward: the batch dimension of every tensor input marked dynamic,
    then the compiled graph. ``eager_linears``: the deferred linears left out of the graph.
    ``static``: every shape compiled as it is, one graph per micro-batch size (a tensor-parallel
    stage: see the module's docstring)."""

    def __init__(self, forward: Callable[..., Any], backend: str, eager_linears: int, static: bool = False) -> None:
        self.backend = backend
        self.eager_linears = eager_linears
        self.static = static
        self._compiled = torch.compile(forward, backend=backend, dynamic=False if static else None)

    def __call__(self, *args: Any) -> Any:
        if not self.static:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        return self._compiled(*args)


# the deferrable linears, opaque to dynamo: they run eagerly, their backward reading the sink when it runs
_DEFERRED = {f: torch._dynamo.disable(f) for f in (weightgrad.linear, weightgrad.addmm)}


def _keep_eager(module: fx.GraphModule, twins: dict[Callable[..., Any], Callable[..., Any]]) -> int:
    """Point ``module``'s calls of ``twins``' keys at their dynamo-disabled twins; how many."""
    count = 0
    for n in module.graph.nodes:
        if n.op == "call_function" and n.target in twins:
            n.target = twins[n.target]
            count += 1
    if count:
        module.recompile()
    return count


def _keep_experts_eager(module: fx.GraphModule) -> int:
    """Point each expert-parallel layer ``module`` calls at a dynamo-disabled forward (its
    all-to-all's sizes are the routing's, read as Python ints); how many. The graph breaks
    around each: the router before it and everything after it compile."""
    from replica.parallel.experts import ExpertParallel

    count = 0
    for n in module.graph.nodes:
        layer = module.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(layer, ExpertParallel) and not getattr(layer.forward, "_torchdynamo_disable", False):
            layer.forward = torch._dynamo.disable(layer.forward)  # an instance attribute: the class stays
            count += 1
    return count


def _compile_regions(module: fx.GraphModule, backend: str, static: bool) -> int:
    """Compile each checkpointed block's region of ``module`` by itself, its
    ``torch.utils.checkpoint`` call left eager around it (dynamo takes only a selective policy's
    ``context_fn``, not the batch norms' recompute context every region carries); how many."""
    count = 0
    for n in module.graph.nodes:
        region = getattr(n.target, CHECKPOINTED, None) if n.op == "call_function" else None
        if region is None:
            continue
        _keep_experts_eager(region)
        _compile_forward(region, backend, 0, static)
        eager = torch._dynamo.disable(n.target)
        setattr(eager, CHECKPOINTED, region)  # FSDP2 finds the region's modules by it
        n.target = eager
        count += 1
    if count:
        module.recompile()
    return count


def _compile_forward(module: fx.GraphModule, backend: str, eager_linears: int, static: bool) -> CompiledStage:
    compiled = CompiledStage(module.forward, backend, eager_linears, static)
    module.forward = compiled  # an instance attribute: the class, and so state_dict's names, stay
    setattr(module, _COMPILED, compiled)
    return compiled


def runs_eagerly(plan: Plan, stage_index: int) -> str:
    """Why stage ``stage_index`` of ``plan`` runs eagerly ("" where it compiles): not compiled by
    the plan. Every stage of a compiled plan compiles (tensor-parallel ones with static shapes,
    expert-parallel layers eager between graphs: see the module's docstring)."""
    if not plan.compile:
        return "the plan does not compile"
    return ""


def check_cpu_compiler(modules: list[torch.nn.Module], backend: str | None = None) -> None:
    """Inductor builds a CPU stage's kernels in C++ at the first step: where none of ``modules``
    (the stages about to compile) is on a GPU and no working C++ compiler is found, a
    ``ConfigError`` now names the fix, instead of torch's error inside the first ``train_step``."""
    if (backend or _backend.get()) != "inductor":
        return
    devices = {p.device.type for m in modules for p in m.parameters()}
    if "cpu" not in devices and torch.cuda.is_available():
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # older torch: its own error at the first step
        return
    try:
        get_cpp_compiler()
    except Exception as exc:  # torch._inductor.exc.InvalidCxxCompiler
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ConfigError(
            f"compile=True compiles {len(modules)} CPU stage(s) with inductor, which builds C++ kernels, but no "
            f"working C++ compiler was found ({said}). Install one (Debian / Ubuntu: apt-get install g++; or set "
            "CXX to a compiler's path), or plan with compile=False (compile=None keeps CPU stages eager)") from exc


def compile_stage(module: fx.GraphModule, *, deferring: bool = False, backend: str | None = None,
                  static: bool = False) -> CompiledStage:
    """Compile ``module`` (a stage) in place: its ``forward`` becomes a :class:`CompiledStage`
    (compiled at its first call), and so does each checkpointed block's region inside it.
    ``deferring``: its linears defer weight gradients (a zero-bubble schedule's W actions), kept
    eager. ``static``: shapes compiled as they are (tensor-parallel stages). ``backend`` None:
    :func:`compile_backend`'s."""
    backend = backend or _backend.get()
    eager = _keep_eager(module, _DEFERRED) if deferring else 0
    _keep_experts_eager(module)
    _compile_regions(module, backend, static)
    return _compile_forward(module, backend, eager, static)


def compiled_stage(module: torch.nn.Module) -> CompiledStage | None:
    """The :class:`CompiledStage` of ``module``, or None where it runs eagerly."""
    return getattr(module, _COMPILED, None)


def compile_seconds() -> float:
    """Seconds this process has spent compiling (dynamo, AOTAutograd and the backend; forward
    and backward graphs), by torch's own account."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return float(spent.get("total_wall_time", 0.0))


def inductor_cache_dir() -> str | None:
    """Where inductor keeps its compiled graphs (``TORCHINDUCTOR_CACHE_DIR``, else a folder under
    the temp dir): a later process compiling the same graphs reads them from there."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older torch
        try:
            from torch._inductor.runtime.runtime_utils import cache_dir  # type: ignore[no-redef]
        except ImportError:
            return os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return str(cache_dir())


def recompiles() -> int:
    """Graphs dynamo has compiled in this process (``unique_graphs``): a count that stays put
    once every micro-batch size has run."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
