"""Run a pipeline across processes: each rank executes its own action list with
``torch.distributed`` point-to-point ops (gloo on CPU, NCCL on GPU).

Every message of a step is known before the step starts (the plan says what
crosses each cut, the shape oracle says its shape); ``pipeline/p2p.py`` fixes the
order both ends of each pair post them in, and a ``Mailbox`` (``pipeline/mailbox.py``)
posts one step's share of this rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from replica.errors import PipelineError, ReplicaError
from replica.layout import Layout
from replica.partition.plan import Plan
from replica.partition.split import StageModule
from replica.pipeline import p2p
from replica.pipeline.clock import NO_CLOCK, StepClock, timing
from replica.pipeline.gradsync import ReplicaReducer
from replica.pipeline.p2p import BWD, FWD
from replica.pipeline.local import RandomStreams, StepResult, holding_several, rebuild_map, run_stage, weighted_loss
from replica.pipeline.mailbox import Mailbox, greet_peers
from replica.pipeline.schedule import (BACKWARD, FORWARD, WEIGHT, Action, Schedule, fused_weight_grads,
                                       placement, splits_backward)
from replica.pipeline.shapes import ShapeOracle, TensorMeta
from replica.pipeline.simulate import Event, Timeline, simulate, stage_costs_from_plan
from replica.pipeline.weightgrad import WeightGrads, collecting

__all__ = ["Topology", "DistributedRuntime", "sending_input_grads"]


def sending_input_grads(stages: Iterable[StageModule], place: dict[int, int]) -> set[int]:
    """The stages that send an input gradient to another rank (``place``: stage -> rank):
    the only ones whose backward gains by sending it before the weight gradients."""
    return {st.stage_index for st in stages if any(place[src] != place[st.stage_index] for src in st.input_sources)}

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Topology:
    """This process's place in a :class:`~replica.layout.Layout`, which does the arithmetic."""

    layout: Layout
    rank: int

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_pipeline_ranks(self) -> int:
        return self.layout.pipeline_ranks

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def pipeline_rank(self) -> int:
        return self.layout.coordinates(self.rank).pipeline_rank

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.rank).data_parallel_rank

    def global_rank(self, pipeline_rank: int, data_parallel_rank: int | None = None) -> int:
        dp = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        return self.layout.global_rank(pipeline_rank, dp)


@dataclass
class _Step:
    """Everything in flight during one step."""

    metas: list[dict[str, Any]]
    mail: Mailbox
    local_values: dict[tuple[str, int], Any] = field(default_factory=dict)
    local_grads: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = field(default_factory=dict)


class DistributedRuntime:
    """Executes this rank's share of a schedule and keeps shared weights in step.

    ``stages`` are all stage modules (the split is the same on every rank); only the
    stages the schedule places on this rank's pipeline position run here.
    """

    def __init__(
        self,
        stages: Sequence[StageModule],
        schedule: Schedule,
        plan: Plan,
        topology: Topology,
        oracle: ShapeOracle,
        *,
        timeout_s: float,
        device: torch.device,
        recompute: bool = False,
    ) -> None:
        self.topology = topology
        self.recompute = recompute
        self.plan = plan
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.oracle = oracle
        self.place = placement(schedule)
        me = topology.pipeline_rank
        self.actions: list[Action] = list(schedule[me])
        self.stages = {s.stage_index: s for s in stages if self.place[s.stage_index] == me}
        self.random = RandomStreams(stages, replica=topology.data_parallel_rank)
        self.parameters = self._local_parameters()
        self.split_backward = splits_backward(schedule)
        # A W right after its own B runs inside that backward, unless the B sends an input
        # gradient to another rank: fused, that gradient would wait for the weight gradients.
        sends_back = sending_input_grads(self.stages.values(), self.place)
        self.fused = {key for key in fused_weight_grads(self.actions) if key[0] not in sends_back}
        # Without W actions (GPipe, 1F1B, interleaved) a backward that sends an input gradient
        # to another rank still runs in two parts, inside its own action: input gradients,
        # sent at once, then the weight gradients while the upstream rank already works.
        self.early = sends_back if plan.early_input_grads and not self.split_backward else set()
        # stage -> the kinds of ops whose outputs it rebuilds in backward (pipeline/remat.py):
        # with plan.pointwise_recompute every kind on the stages that hold several micro-batches
        # at once and those that hold a backward's layer inputs and output gradients until the
        # input gradients have left (early); else the plan's rebuilds (replica.planner.refine.finish)
        every = (holding_several(schedule, len(stages)) | self.early) if plan.pointwise_recompute else set()
        self.pointwise_recompute = {k: kinds for k, kinds in rebuild_map(every, plan.rebuilds).items()
                                    if k in self.stages}
        # the action after which a stage's gradients are final (its last B, or W when split)
        self.last_backward = {
            s: max(k for k, a in enumerate(self.actions) if a.stage_index == s and a.kind != FORWARD)
            for s in self.stages
        }
        self._make_groups()
        self.clock: StepClock = NO_CLOCK  # measure_step's, while it runs
        self.messages = {train: self._message_order(schedule, train) for train in (True, False)}
        greet_peers(self.messages[True] + self.messages[False], me=topology.pipeline_rank, rank=topology.rank,
                    global_rank=topology.global_rank, device=device, wait=self._wait)

    # --- set-up ------------------------------------------------------------------------
    def _local_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters by canonical name (a tied weight under its first name)."""
        canonical = {a: name for name, aliases in self.plan.tied_parameters.items() for a in aliases}
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for k in sorted(self.stages):
            for name, p in self.stages[k].module.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), (canonical.get(name, name), p))
        return list(seen.values())

    def _make_groups(self) -> None:
        """Process groups, created in the same order on every rank (``new_group`` is collective)."""
        topo, P, D = self.topology, self.topology.num_pipeline_ranks, self.topology.data_parallel_size
        self.pipeline_group = None
        for dp in range(D):
            group = dist.new_group([topo.global_rank(r, dp) for r in range(P)], timeout=self.timeout)
            if dp == topo.data_parallel_rank:
                self.pipeline_group = group
        self.data_parallel_group = None
        if D > 1:
            for r in range(P):
                group = dist.new_group([topo.global_rank(r, dp) for dp in range(D)], timeout=self.timeout)
                if r == topo.pipeline_rank:
                    self.data_parallel_group = group
        # A weight read by stages on several ranks (a tied embedding and head): its
        # gradient is summed over exactly those ranks (of every replica).
        self.tied: list[tuple[Any, list[str]]] = []
        local = {name for name, _ in self.parameters}
        holders: dict[str, set[int]] = {}
        for s in self.plan.stages:
            for name in s.parameter_names:
                holders.setdefault(name, set()).add(self.place[s.stage_index])
        for name in sorted(holders):
            ranks = sorted(holders[name])
            if len(ranks) < 2:
                continue
            members = [topo.global_rank(r, dp) for dp in range(D) for r in ranks]
            group = dist.new_group(members, timeout=self.timeout)
            if topo.rank in members:
                self.tied.append((group, [name] if name in local else []))
        self.tied_names = {n for _, names in self.tied for n in names}
        # Each stage's gradients are averaged over the replicas as its last backward finishes
        # them; a weight two local stages share goes with the one whose last backward is later.
        self.reducer: ReplicaReducer | None = None
        if self.data_parallel_group is not None:
            owner: dict[int, int] = {}
            for k in sorted(self.stages, key=lambda k: self.last_backward[k]):
                for name, p in self.stages[k].module.named_parameters():
                    if name not in self.tied_names and p.requires_grad:
                        owner[id(p)] = k
            params = {k: [p for p in dict.fromkeys(self.stages[k].module.parameters()) if owner.get(id(p)) == k]
                      for k in sorted(self.stages)}
            self.reducer = ReplicaReducer(params, self.data_parallel_group, D, self._wait)

    def _message_order(self, schedule: Schedule, train: bool) -> list[p2p.Message]:
        """This rank's messages of a training (or inference) step, in the order both ends
        of each pair post them; checked against NCCL's rules."""
        edges = [(b.name, b.source_stage, d) for s in self.plan.stages for b in s.outputs
                 for d in b.destination_stages]
        messages = p2p.step_messages(edges, self.place, self.plan.num_microbatches, train=train)
        actions = schedule if train else self._inference_actions(schedule)
        priority = None
        if train:  # ties between ranks go to the action the plan's times say starts first
            try:
                timeline = simulate(schedule, stage_costs_from_plan(self.plan, schedule))
                priority = {e.action: e.start_s for e in timeline.events}
            except ReplicaError:
                priority = None
        full = p2p.ordered(messages, p2p.linearize(actions, messages, priority))
        p2p.check_fifo(actions, full)
        me = self.topology.pipeline_rank
        return [msg for msg in full if me in (msg.source, msg.dest)]

    @staticmethod
    def _inference_actions(schedule: Schedule) -> Schedule:
        """Each rank's forwards in the order inference runs them: micro-batch by micro-batch."""
        return [sorted((a for a in actions if a.kind == FORWARD), key=lambda a: (a.microbatch_index, a.stage_index))
                for actions in schedule]

    # --- messages ----------------------------------------------------------------------
    def _wait(self, work: Any, what: str, peer: int | str) -> None:
        """Wait for one message or collective; a dead or silent peer becomes a ``PipelineError``."""
        source = f"rank {peer}" if isinstance(peer, int) else peer
        try:
            done = work.wait(self.timeout)
        except Exception as exc:  # gloo raises on a closed connection or a timeout
            reason = str(exc).splitlines()[0] if str(exc) else ""
            raise PipelineError(
                f"rank {self.topology.rank} gave up waiting for {what} from {source}: {type(exc).__name__}: "
                f"{reason}. {source.capitalize()} died, hung or runs a different plan; the timeout is "
                f"{self.timeout.total_seconds():.0f} s (auto_parallel(..., timeout_s=...))."
            ) from exc
        if done is False:
            raise PipelineError(
                f"rank {self.topology.rank} timed out after {self.timeout.total_seconds():.0f} s waiting for "
                f"{what} from {source}"
            )

    def _step(self, microbatches: Sequence[tuple[Any, ...]], train: bool) -> _Step:
        metas = [self.oracle(mb) for mb in microbatches]
        mail = Mailbox(self.messages[train], metas, me=self.topology.pipeline_rank,
                       global_rank=self.topology.global_rank, device=self.device, wait=self._wait)
        return _Step(metas=metas, mail=mail)

    def _received(self, step: _Step, key: tuple[str, int, int, int], action: Action) -> torch.Tensor:
        what = f"{'activation' if key[3] == FWD else 'gradient'} {key[0]!r} of micro-batch {key[2]} (for {action})"
        value = step.mail.receive(key, what)
        self.clock.ready()
        return value

    # --- actions -----------------------------------------------------------------------
    def _forward(self, step: _Step, action: Action, inputs: tuple[Any, ...], train: bool) -> Any:
        stage = self.stages[action.stage_index]
        i = action.microbatch_index
        meta = step.metas[i]
        if stage.is_first:
            args = inputs
        else:
            values = []
            for name, src in zip(stage.input_names, stage.input_sources):
                m = meta[name]
                if not isinstance(m, TensorMeta):
                    values.append(m)  # a Python value: worked out locally, never sent
                    continue
                if self.place[src] == self.place[stage.stage_index]:
                    value = step.local_values[(name, i)]
                else:
                    value = self._received(step, (name, stage.stage_index, i, FWD), action)
                values.append(value.detach().requires_grad_(train and m.requires_grad))
            args = tuple(values)
        out = run_stage(stage, args, self.recompute and train, self.random.seed(stage.stage_index, i),
                        pointwise=self.pointwise_recompute.get(stage.stage_index, False))
        if not stage.is_last:
            for name, readers, value in zip(stage.output_names, stage.output_destinations, out):
                if not isinstance(value, torch.Tensor):
                    continue
                for d in readers:
                    if self.place[d] == self.place[stage.stage_index]:
                        step.local_values[(name, i)] = value
                    else:
                        step.mail.send((name, d, i, FWD), value)
        if train:
            step.saved[(stage.stage_index, i)] = (args, out)
        return out

    def _backward(self, step: _Step, action: Action, loss: torch.Tensor | None) -> None:
        stage = self.stages[action.stage_index]
        k, i = stage.stage_index, action.microbatch_index
        args, out = step.saved.pop((k, i))
        meta = step.metas[i]
        if stage.is_last:
            tensors, grads = [loss], [None]
        else:
            tensors, grads = [], []
            for name, readers, value in zip(stage.output_names, stage.output_destinations, out):
                m = meta[name]
                if not (isinstance(m, TensorMeta) and m.requires_grad):
                    continue
                total = None
                for d in readers:
                    if self.place[d] == self.place[k]:
                        g = step.local_grads.pop((name, i, d))
                    else:
                        g = self._received(step, (name, d, i, BWD), action)
                    total = g if total is None else total + g
                if value.requires_grad:
                    tensors.append(value)
                    grads.append(total)
        if tensors:
            torch.autograd.backward(tensors, grads)
        if stage.is_first:
            return
        for name, src, leaf in zip(stage.input_names, stage.input_sources, args):
            m = meta[name]
            if not (isinstance(m, TensorMeta) and m.requires_grad):
                continue
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if self.place[src] == self.place[k]:
                step.local_grads[(name, i, k)] = g
            else:
                step.mail.send((name, k, i, BWD), g)

    # --- steps -------------------------------------------------------------------------
    def train_step(
        self,
        microbatches: Sequence[tuple[Any, ...]],
        targets: Sequence[Any],
        loss_fn: LossFn,
        weights: Sequence[float],
    ) -> StepResult:
        stash = {}
        for _, p in self.parameters:  # this step's gradients are reduced alone, then added
            stash[id(p)] = p.grad
            p.grad = None
        step = self._step(microbatches, train=True)
        self.random.new_step()
        if self.reducer is not None:
            self.reducer.new_step()
        losses: dict[int, torch.Tensor] = {}  # detached: the graph goes with its backward
        attached: dict[int, torch.Tensor] = {}  # a last stage's losses until their backward
        deferred: dict[tuple[int, int], WeightGrads] = {}
        clock = self.clock
        for n, action in enumerate(self.actions):
            clock.begin()
            stage = self.stages[action.stage_index]
            i = action.microbatch_index
            last = n == self.last_backward[action.stage_index]
            split = self.split_backward and (action.stage_index, i) not in self.fused
            early = action.stage_index in self.early
            if last and self.reducer is not None:  # hooks only see final gradients when autograd makes them all
                self.reducer.arm(action.stage_index, listen=action.kind == BACKWARD and not (split or early))
            if action.kind == FORWARD:
                out = self._forward(step, action, microbatches[i], train=True)
                if stage.is_last:
                    attached[i] = weighted_loss(loss_fn, out, targets[i], weights[i])
                    losses[i] = attached[i].detach()
                del out  # the graph stays only where its backward will let go of it
                clock.end(action)
            elif action.kind == BACKWARD:
                # W inside B: weight gradients straight into .grad, unless the reducer's hooks
                # must see autograd accumulate them (the last backward, data-parallel)
                listening = last and self.reducer is not None
                sink = WeightGrads() if split or early else (None if listening else WeightGrads(now=True))
                with collecting(sink):
                    self._backward(step, action, attached.pop(i) if stage.is_last else None)
                clock.end(action)
                if early:
                    sink.apply()
                    clock.end(Action(action.stage_index, WEIGHT, i))  # the weight gradients, after the send
                else:
                    deferred[(action.stage_index, i)] = sink
            elif (action.stage_index, i) not in self.fused:  # W: the weight gradients B left for later
                deferred.pop((action.stage_index, i)).apply()
                clock.end(action)
            if last and self.reducer is not None:
                self.reducer.flush(action.stage_index)
        step.mail.finish()
        if self.reducer is not None:
            self.reducer.finish()
        self._reduce_tied()
        for _, p in self.parameters:
            old = stash[id(p)]
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        total = torch.stack(list(losses.values())).sum() if losses else torch.zeros(())
        total = total.to(self.device)
        work = dist.all_reduce(total, async_op=True)
        self._wait(work, "the loss all-reduce", "every rank")
        return StepResult((total / self.topology.data_parallel_size).cpu(), [])

    def measure_step(
        self,
        microbatches: Sequence[tuple[Any, ...]],
        targets: Sequence[Any],
        loss_fn: LossFn,
        weights: Sequence[float],
    ) -> tuple[StepResult, Timeline]:
        """:meth:`train_step`, timing every action: the replica's measured timeline, on each
        of its pipeline ranks. The ranks start the step together (a barrier) and each times
        its actions from there, so clocks of different machines need not agree."""
        what = "the pipeline ranks' barrier before a measured step"
        self._wait(dist.all_reduce(torch.zeros(1, device=self.device), group=self.pipeline_group, async_op=True),
                   what, "every pipeline rank")
        with timing(self) as clock:
            result = self.train_step(microbatches, targets, loss_fn, weights)
        step_s = clock.now()
        kinds = (FORWARD, BACKWARD, WEIGHT)
        mine = torch.tensor([[a.stage_index, kinds.index(a.kind), a.microbatch_index, start, end]
                             for a, start, end in clock.records] + [[-1, 0, 0, 0.0, step_s]],
                            dtype=torch.float64, device=self.device)  # the last row: when the step ended
        ranks = self.topology.num_pipeline_ranks
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(ranks)]
        self._wait(dist.all_gather(counts, torch.tensor([len(mine)], device=self.device),
                                   group=self.pipeline_group, async_op=True), "the measured steps' sizes",
                   "every pipeline rank")
        rows = int(max(c.item() for c in counts))
        padded = torch.zeros(rows, 5, dtype=torch.float64, device=self.device)
        padded[:len(mine)] = mine
        gathered = [torch.empty_like(padded) for _ in range(ranks)]
        self._wait(dist.all_gather(gathered, padded, group=self.pipeline_group, async_op=True),
                   "the measured steps' records", "every pipeline rank")
        events, ends = [], []
        for rank, (table, count) in enumerate(zip(gathered, counts)):
            *records, last = table[:int(count.item())].tolist()
            ends.append(last[4])
            events += [Event(rank, Action(int(k), kinds[int(kind)], int(i)), start, end)
                       for k, kind, i, start, end in records]
        return result, Timeline.from_events(events, num_ranks=ranks, step_time_s=max(ends))

    def _reduce_tied(self) -> None:
        """Sum each tied weight's gradient over the ranks holding it; average over replicas."""
        by_name = dict(self.parameters)
        for group, names in self.tied:
            for name in names:
                p = by_name[name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                work = dist.all_reduce(p.grad, group=group, async_op=True)
                self._wait(work, f"the all-reduce of tied weight {name!r}", "the ranks sharing it")
                if self.topology.data_parallel_size > 1:
                    p.grad /= self.topology.data_parallel_size

    def forward(self, microbatches: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Pipelined inference: the last stage's outputs, broadcast to every pipeline rank."""
        m = len(microbatches)
        step = self._step(microbatches, train=False)
        self.random.new_step()
        outputs: list[Any] = [None] * m
        forwards = self._inference_actions([self.actions])[0]
        with torch.no_grad():
            for action in forwards:
                out = self._forward(step, action, microbatches[action.microbatch_index], train=False)
                if self.stages[action.stage_index].is_last:
                    outputs[action.microbatch_index] = out
        step.mail.finish()
        return [self._broadcast_output(outputs[i], step.metas[i]["output"]) for i in range(m)]

    def _broadcast_output(self, out: Any, meta_out: Any) -> Any:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        last = self.topology.global_rank(self.place[self.plan.num_stages - 1])
        leaves, spec = tree_flatten(meta_out)
        mine = tree_flatten(out)[0] if out is not None else None
        result = []
        for n, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                result.append(mine[n] if mine is not None else leaf)
                continue
            buf = mine[n].contiguous() if mine is not None else torch.empty(leaf.shape, dtype=leaf.dtype,
                                                                            device=self.device)
            work = dist.broadcast(buf, last, group=self.pipeline_group, async_op=True)
            self._wait(work, "the output broadcast", last)
            result.append(buf)
        return tree_unflatten(result, spec)

