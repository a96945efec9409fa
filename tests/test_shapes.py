"""The shape oracle: what crosses each cut, worked out on fake tensors, is what a real run makes;
ops with data-dependent sizes or without a usable meta kernel are followed; what cannot be is
named with its op and stage."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import replica
from replica.partition.trace import trace
from replica.runtime.shapes import ShapeOracle, TensorMeta
from tests import moe
from tests.conftest import COMPUTE_BOUND

# --------------------------------------------------------------------------- models with data at a cut


class RaggedCut(nn.Module):
    """Keeps the rows whose first feature is positive: on two stages, a variable number of rows
    (and their indices) crosses the cut. (B, dim) -> (B, 4)."""

    def __init__(self, dim: int = 16, depth: int = 2, post_depth: int = 4) -> None:
        super().__init__()
        self.pre = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])
        self.post = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(post_depth)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(x)  # (B, dim)
        rows = torch.where(h[:, 0] > 0)[0]  # (n,): n depends on the data
        return self.head(h.index_add(0, rows, self.post(h[rows])))


class CountAtCut(nn.Module):
    """Counts the positive rows with ``.item()`` first and scales by the count last: on two
    stages, a data-dependent Python number crosses the cut. (B, dim) -> (B, dim)."""

    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.pre = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])
        self.post = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        n = (x[:, 0] > 0).sum().item()
        return self.post(self.pre(x)) * n


class KeptRows(nn.Module):
    """Returns the rows whose first feature is positive and how many: an output whose length,
    and a Python number, depend on the data. (B, dim) -> ((n, dim), n)."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        h = self.layers(x)
        rows = torch.where(h[:, 0] > 0)[0]
        return h[rows], rows.numel()


@torch.library.custom_op("replica_test::picky", mutates_args=())
def picky(x: Tensor) -> Tensor:
    """Doubles ``x``; refuses an all-zero input (as an op whose real kernel checks its data)."""
    if not bool((x != 0).any()):
        raise RuntimeError("picky got an all-zero input")
    return x * 2


@picky.register_fake
def _(x: Tensor) -> Tensor:
    raise RuntimeError("picky has no fake kernel for these inputs")


@torch.library.custom_op("replica_test::unfaked", mutates_args=())
def unfaked(x: Tensor) -> Tensor:
    """``x + 1`` in fp32 (as grouped_mm, whose meta kernel takes only bf16: its fake kernel refuses)."""
    return x + 1


@unfaked.register_fake
def _(x: Tensor) -> Tensor:
    raise RuntimeError("unfaked's fake kernel takes only bf16")


class UnfakedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return unfaked(self.linear(x)).repeat(1, 2)  # (B, 2 * dim)


class PickyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return picky(self.linear(x))


class Picky(nn.Module):
    """Linear, the block calling ``picky``, linear. (B, dim) -> (B, dim)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.inner = PickyBlock(dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.inner(self.a(x)))


class ExpertsHit(nn.Module):
    """Hugging Face's older Mixtral loop: only the experts that got a token run, ``for e in hit``
    (a loop whose length depends on the data: no tracer follows it, so it is kept whole with
    ``leaf_modules=``). (N, dim) -> (N, dim), whatever the routing."""

    def __init__(self, dim: int = 16, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_experts))

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = torch.topk(self.gate(x).softmax(-1), self.top_k)  # (N, top_k) each
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # the experts hit: how many depends on the data
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class HitMoE(nn.Module):
    """Linear, :class:`ExpertsHit`, linears. (B, dim) -> (B, dim)."""

    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.moe = ExpertsHit(dim)
        self.post = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        return self.post(x + self.moe(self.pre(x)))


class KeptIfAny(nn.Module):
    """Kept whole: the rows whose first feature is positive, or the first row where none is (a
    branch on the data). Its output's length follows the data. (B, dim) -> (n, dim)."""

    def forward(self, x: Tensor) -> Tensor:
        keep = x[:, 0] > 0
        return x[keep] if bool(keep.any()) else x[:1]


class LeafRowsAtCut(nn.Module):
    """A linear, :class:`KeptIfAny`, linears: on two stages rows it kept cross the cut.
    (B, dim) -> (1, dim)."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.rows = KeptIfAny()
        self.post = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        return self.post(self.rows(self.pre(x))).sum(0, keepdim=True)


# --------------------------------------------------------------------------- helpers


def _oracle(model: nn.Module, inputs: tuple, num_stages: int = 2,
            leaf_modules: tuple = ()) -> tuple[ShapeOracle, replica.Plan, Any]:
    plan = replica.plan(model, inputs, num_stages=num_stages, num_microbatches=2, device=COMPUTE_BOUND,
                        leaf_modules=leaf_modules)
    traced = trace(model, inputs, leaf_modules=leaf_modules)
    assert {n.name for n in traced.module.graph.nodes} >= {n for s in plan.stages for n in s.node_names}
    return ShapeOracle(traced.module, plan.stages, torch.device("cpu"), traced.out_spec), plan, traced


def _real(traced: Any, plan: replica.Plan, inputs: tuple) -> dict[str, Any]:
    """Every value crossing a cut, and the output, from a real run of the graph."""
    names = {b.name for s in plan.stages for b in s.outputs}
    found: dict[str, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n.name in names or n.op == "output":
                found[n.name] = result
            return result

    Keep(traced.module).run(*inputs)
    return found


def _assert_matches(metas: dict[str, Any], real: dict[str, Any]) -> None:
    assert set(metas) == set(real)
    for name, value in real.items():
        meta = metas[name]
        if name == "output":
            value, meta = tree_flatten(value)[0][0], tree_flatten(meta)[0][0]
        if isinstance(value, Tensor):
            assert isinstance(meta, TensorMeta) and not meta.dynamic, (name, meta)
            assert (meta.shape, meta.dtype) == (tuple(value.shape), value.dtype), (name, meta, value.shape)
            assert meta.requires_grad == value.requires_grad, name
        else:
            assert meta == value, (name, meta, value)


# --------------------------------------------------------------------------- tests


def test_tensor_meta_with_a_data_dependent_dim() -> None:
    meta = TensorMeta((None, 16), torch.float32, True)
    assert meta.dynamic and not TensorMeta((3, 16), torch.float32, True).dynamic
    assert meta.agrees((5, 16)) and meta.agrees((0, 16))
    assert not meta.agrees((5, 8)) and not meta.agrees((5, 16, 1))
    assert meta.empty(torch.device("cpu"), (5, 16)).shape == (5, 16)


@pytest.mark.parametrize("experts", ["loop", pytest.param("grouped_mm", marks=pytest.mark.skipif(
    not moe.HAS_GROUPED_MM, reason="no fp32 torch.nn.functional.grouped_mm on CPU in this torch"))])
def test_moe_boundaries_are_a_real_runs(experts: str, caplog: pytest.LogCaptureFixture) -> None:
    """A torchtitan-style MoE (nonzero per expert, or fp32 grouped_mm, whose meta kernel takes only
    bf16) on two stages: the oracle's metas equal a real run's, for micro-batches of any size
    and routing, an expert without tokens included; nothing scary is logged."""
    model, (ids,), _, _ = moe.moe_transformer(8, experts=experts)
    moe.starve(model, 3)
    oracle, plan, traced = _oracle(model, (ids,))
    assert any(s.outputs for s in plan.stages)
    for batch in (4, 3, 1):
        x = torch.randint(0, 32, (batch, 8))
        assert moe.routing(model, x)[0][3] == 0
        caplog.clear()  # planning logs the failing meta kernel: torch.export's and the planner's business
        with caplog.at_level(logging.ERROR):
            metas = oracle((x,))
        assert not [r for r in caplog.records if "failed while attempting" in r.getMessage()]
        _assert_matches(metas, _real(traced, plan, (x,)))


def test_the_oracle_runs_once_per_input_shapes() -> None:
    model, (ids,), _, _ = moe.moe_transformer(8)
    oracle, _, _ = _oracle(model, (ids,))
    first = oracle((ids[:4],))
    assert oracle((torch.randint(0, 32, (4, 8)),)) is first  # other data, same shapes: cached
    assert oracle((ids[:3],)) is not first
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert oracle((ids[:4],)) is not first
    assert len(oracle._cache) == 3


def test_under_autocast_the_dtypes_are_autocasts() -> None:
    model, (ids,), _, _ = moe.moe_transformer(8)
    oracle, plan, traced = _oracle(model, (ids,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_matches(oracle((ids[:4],)), _real(traced, plan, (ids[:4],)))


def test_a_tensor_whose_length_depends_on_the_data_crosses_as_dynamic() -> None:
    """Its data-dependent dim is None (its size travels with it); the rest is fixed."""
    model = RaggedCut()
    oracle, plan, _ = _oracle(model, (torch.randn(8, 16),))
    metas = oracle((torch.randn(4, 16),))
    cut = {b.name: metas[b.name] for b in plan.stages[0].outputs}
    dynamic = {name: m for name, m in cut.items() if m.dynamic}
    assert {m.shape for m in dynamic.values()} == {(None,), (None, 16)}, cut
    assert {(m.dtype, m.requires_grad) for m in dynamic.values()} == {(torch.int64, False), (torch.float32, True)}
    assert any(m.shape == (4, 16) for m in cut.values())  # h itself: every row
    assert metas["output"] == TensorMeta((4, 4), torch.float32, True)


def test_an_output_sized_by_the_data_is_marked() -> None:
    """Its tensor's data-dependent dim is None; its data-dependent Python number only the last
    stage knows (the runtime broadcasts it)."""
    from replica.runtime.shapes import DATA_DEPENDENT

    oracle, _, _ = _oracle(KeptRows(), (torch.randn(8, 16),))
    assert oracle((torch.randn(4, 16),))["output"] == (TensorMeta((None, 16), torch.float32, True), DATA_DEPENDENT)


def test_a_data_dependent_python_value_at_a_cut_is_named_with_its_stages() -> None:
    model = CountAtCut()
    oracle, plan, _ = _oracle(model, (torch.randn(8, 16),))
    assert [b.name for b in plan.stages[0].outputs if b.shape is None] == ["item"]
    with pytest.raises(replica.PipelineError) as info:
        oracle((torch.randn(4, 16),))
    message = str(info.value)
    for part in ("'item'", "stage 0", "stage(s) [1]", "depends on the data", "move the cut", "leaf_modules"):
        assert part in message, (part, message)


@pytest.mark.parametrize("leaf", [False, True])
def test_an_op_whose_fake_kernel_refuses_runs_once_on_zeros(leaf: bool) -> None:
    """As a call of its own, or inside a module kept whole (then the module runs on zeros, its
    weights too): its outputs' shapes and dtypes are the real kernel's."""
    model = nn.Sequential(nn.Linear(16, 16), UnfakedBlock(16), nn.Linear(32, 32), nn.Linear(32, 4))
    oracle, plan, traced = _oracle(model, (torch.randn(8, 16),), leaf_modules=(UnfakedBlock,) if leaf else ())
    kinds = {n.op for n in traced.module.graph.nodes if "unfaked" in str(n.target) or n.target == "1"}
    assert kinds == ({"call_module"} if leaf else {"call_function"})
    x = torch.randn(3, 16)
    _assert_matches(oracle((x,)), _real(traced, plan, (x,)))


def test_a_module_kept_whole_that_loops_on_the_data_runs_once_on_zeros() -> None:
    """The tracer cannot follow ``for e in hit`` and says to keep the module whole; fake tensors
    cannot either (a guard on a data-dependent size), so it runs on zeros: its output's shape is
    the real one's, for any routing."""
    model = HitMoE()
    with pytest.raises(replica.TraceError, match=r"leaf_modules=\[ExpertsHit\]"):
        trace(model, (torch.randn(8, 16),))
    oracle, plan, traced = _oracle(model, (torch.randn(8, 16),), leaf_modules=(ExpertsHit,))
    assert [n.op for n in traced.module.graph.nodes if n.target == "moe"] == ["call_module"]
    for batch in (4, 3):
        x = torch.randn(batch, 16)
        _assert_matches(oracle((x,)), _real(traced, plan, (x,)))


def test_an_op_the_oracle_cannot_run_is_named_with_its_stage_not_a_cut() -> None:
    """An op that fails on fake tensors and on zeros: the error names it, its stage and module,
    and both reasons; no cut is blamed."""
    model = Picky()
    oracle, plan, _ = _oracle(model, (torch.randn(8, 16),))
    stage = next(s.stage_index for s in plan.stages if "picky_default" in s.node_names)
    with pytest.raises(replica.PipelineError) as info:
        oracle((torch.randn(4, 16),))
    message = str(info.value)
    for part in ("op 'picky_default' (picky.default)", f"stage {stage} (module 'inner')", "no fake kernel",
                 "all-zero input", "register_fake", "[(4, 16)]"):
        assert part in message, (part, message)
    assert "at a cut" not in message


def test_a_value_a_python_number_makes_through_tolist_is_followed() -> None:
    """torchtitan's loop splits the sorted tokens by ``counts.tolist()``: sizes known only with
    the data, followed as symbols through split and cat to a fixed-size result."""

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.w, self.out = nn.Linear(16, 3), nn.Parameter(torch.randn(3, 16, 16)), nn.Linear(16, 4)

        def forward(self, x: Tensor) -> Tensor:
            chosen = self.gate(x).argmax(-1)
            order = torch.argsort(chosen)
            counts = torch.histc(chosen.float(), bins=3, min=0, max=3).long()
            parts = torch.split(x[order], counts.tolist())
            y = torch.cat([parts[e] @ self.w[e] for e in range(3)])
            return self.out(torch.zeros_like(x).index_add(0, order, y))

    model = Split()
    oracle, plan, traced = _oracle(model, (torch.randn(8, 16),), num_stages=1)
    x = torch.randn(4, 16)
    assert oracle((x,))["output"] == TensorMeta((4, 4), torch.float32, True)


# --------------------------------------------------------------------------- a dynamic tensor on the wire


class _Work:
    """A posted op that completes when waited for (or at once if ``done``)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        self.done = True
        return True


def _dynamic_step(monkeypatch: pytest.MonkeyPatch, me: int, rows: list[int]) -> tuple[Any, list[tuple]]:
    """A 2-stage 1F1B step of 3 micro-batches whose one activation has ``rows[i]`` rows, seen
    from pipeline rank ``me``; every op it posts, in order, as (kind, shape or size sent)."""
    from replica.runtime import mailbox
    from replica.runtime.p2p import linearize, ordered, step_messages
    from replica.schedules.schedule import make_schedule, placement

    posted: list[tuple] = []
    arriving = iter(rows)

    def irecv(tensor: Tensor, peer: int, tag: int = 0) -> _Work:
        if tensor.dtype == torch.int64:  # a shape: the sender's, arriving later
            tensor.copy_(torch.tensor([next(arriving), 16]))
            posted.append(("recv shape", None))
            return _Work(False)
        posted.append(("recv", tuple(tensor.shape)))
        return _Work(True)

    def isend(tensor: Tensor, peer: int, tag: int = 0) -> _Work:
        posted.append(("send shape", tuple(tensor.tolist())) if tensor.dtype == torch.int64 else
                      ("send", tuple(tensor.shape)))
        return _Work(True)

    monkeypatch.setattr(mailbox.dist, "irecv", irecv)
    monkeypatch.setattr(mailbox.dist, "isend", isend)
    schedule = make_schedule("1f1b", 2, 3)
    messages = step_messages([("x0", 0, 1)], placement(schedule), 3, train=True)
    messages = ordered(messages, linearize(schedule, messages))
    metas = [{"x0": TensorMeta((None, 16), torch.float32, True)} for _ in range(3)]
    mail = mailbox.Mailbox(messages, metas, me=me, global_rank=lambda r: r, device=torch.device("cpu"),
                           wait=lambda work, what, peer: work.wait())
    return mail, posted, messages


def test_a_dynamic_tensor_is_received_after_its_shape_in_the_pairs_order(monkeypatch) -> None:
    """The receiver posts the shape's receive in the tensor's place, the tensor's once the shape
    is in; the pair's later ops wait behind it; its gradients go back in the shapes received."""
    from replica.runtime.p2p import FWD

    rows = [3, 0, 5]
    mail, posted, messages = _dynamic_step(monkeypatch, me=1, rows=rows)
    assert posted == [("recv shape", None)]  # its shape not in yet: nothing after it is posted
    for msg in messages:
        if msg.direction == FWD:
            assert mail.receive(msg.key, "activation").shape == (rows[msg.microbatch], 16)
        else:
            mail.send(msg.key, torch.zeros(rows[msg.microbatch], 16))
    mail.finish()
    received = [shape for kind, shape in posted if kind == "recv"]
    assert received == [(r, 16) for r in rows]
    assert all(posted[posted.index(("recv", r)) - 1] == ("recv shape", None) for r in received)
    assert [shape for kind, shape in posted if kind == "send"] == received
    pair_order = ["recv" if m.direction == FWD else "send" for m in messages]
    assert [kind for kind, _ in posted if kind != "recv shape"] == pair_order


def test_a_dynamic_tensor_is_sent_after_its_shape(monkeypatch) -> None:
    """The sender sends the shape, then the tensor; its gradient comes back in the shape it sent."""
    from replica.runtime.p2p import FWD

    mail, posted, messages = _dynamic_step(monkeypatch, me=0, rows=[])
    rows = {0: 3, 1: 0, 2: 5}
    for msg in messages:
        if msg.direction == FWD:
            mail.send(msg.key, torch.zeros(rows[msg.microbatch], 16))
        else:
            assert mail.receive(msg.key, "gradient").shape == (rows[msg.microbatch], 16)
    mail.finish()
    sent = [(kind, shape) for kind, shape in posted if kind.startswith("send")]
    assert sent == [op for i in range(3) for op in (("send shape", (rows[i], 16)), ("send", (rows[i], 16)))]
    assert [shape for kind, shape in posted if kind == "recv"] == [(3, 16), (0, 16), (5, 16)]


def test_a_made_send_behind_a_shape_goes_out_before_a_rank_blocks_elsewhere(monkeypatch) -> None:
    """Rank 1 made a send to rank 0 that waits behind a dynamic tensor's shape from rank 0; about
    to block on a receive from rank 2, it first waits for that shape and posts the send (rank 0
    may need it before rank 2 can send anything)."""
    from replica.runtime import mailbox
    from replica.runtime.p2p import BWD, FWD, Message
    from replica.schedules.schedule import BACKWARD, FORWARD, Action

    events: list[str] = []

    class Work(_Work):
        def __init__(self, name: str, done: bool) -> None:
            super().__init__(done)
            self.name = name

        def wait(self, timeout: Any = None) -> bool:
            events.append(f"wait {self.name}")
            return super().wait(timeout)

    def irecv(tensor: Tensor, peer: int, tag: int = 0) -> Work:
        if tensor.dtype == torch.int64:
            tensor.copy_(torch.tensor([2, 16]))
            events.append(f"recv shape from {peer}")
            return Work(f"shape from {peer}", False)
        events.append(f"recv {tuple(tensor.shape)} from {peer}")
        return Work(f"recv from {peer}", False)

    def isend(tensor: Tensor, peer: int, tag: int = 0) -> Work:
        events.append(f"send to {peer}")
        return Work(f"send to {peer}", True)

    monkeypatch.setattr(mailbox.dist, "irecv", irecv)
    monkeypatch.setattr(mailbox.dist, "isend", isend)
    h = Message("h", 1, 0, FWD, Action(0, FORWARD, 0), Action(1, FORWARD, 0), 0, 1)  # dynamic, from rank 0
    g = Message("g", 1, 0, BWD, Action(1, BACKWARD, 0), Action(0, BACKWARD, 0), 1, 0)  # to rank 0, behind h
    x = Message("x", 1, 1, FWD, Action(2, FORWARD, 1), Action(1, FORWARD, 1), 2, 1)  # from rank 2
    metas = [{"h": TensorMeta((None, 16), torch.float32, True), "g": TensorMeta((4,), torch.float32, True)},
             {"x": TensorMeta((4,), torch.float32, True)}]
    mail = mailbox.Mailbox([h, g, x], metas, me=1, global_rank=lambda r: r, device=torch.device("cpu"),
                           wait=lambda work, what, peer: work.wait())
    assert events == ["recv shape from 0", "recv (4,) from 2"]
    mail.send(g.key, torch.zeros(4))
    assert events[-1] == "recv (4,) from 2"  # g waits behind h's shape
    mail.receive(x.key, "activation 'x'")
    assert events[2:6] == ["wait shape from 0", "recv (2, 16) from 0", "send to 0", "wait recv from 2"], events
