"""Run a pipeline across processes: each rank executes its own action list with
``torch.distributed`` point-to-point ops (gloo on CPU, NCCL on GPU).

Every message of a step is known before the step starts (the plan says what
crosses each cut, the shape oracle says its shape); ``runtime/p2p.py`` fixes the
order both ends of each pair post them in, and a ``Mailbox`` (``runtime/mailbox.py``)
posts one step's share of this rank.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from replica.errors import PipelineError
from replica.parallel.experts import expert_parameters, sync_expert_grads
from replica.parallel.fsdp import local_tensor, reshard
from replica.parallel.gradsync import ReplicaReducer
from replica.parallel.mesh import ParallelMesh
from replica.parallel.parallelize import StageFlags
from replica.parallel.tensor_parallel import match_grad_placements
from replica.partition.plan import Plan
from replica.partition.split import StageModule
from replica.precision import ambient_autocast, autocast_for
from replica.runtime import p2p
from replica.runtime.clock import timing
from replica.runtime.executor import Executor, LossFn, Step, StepResult
from replica.runtime.mailbox import Mailbox, greet_peers, post
from replica.runtime.shapes import DATA_DEPENDENT, ShapeOracle, TensorMeta
from replica.schedules.schedule import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from replica.schedules.simulate import Event, Timeline

__all__ = ["DistributedRuntime"]

_AUTOCAST_TAG = 1  # the autocast check's messages; a step's are all tag 0 (runtime/mailbox.py)


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
        mesh: ParallelMesh,
        flags: StageFlags,
        oracle: ShapeOracle,
        *,
        timeout_s: float,
        device: torch.device,
        recompute: bool | Mapping[int, str] = False,
        precision: str = "fp32",
    ) -> None:
        self.topology = mesh  # where this rank sits, and the groups of its layout
        self.plan = plan
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.oracle = oracle
        me = mesh.pipeline_rank
        self.sharded = flags.sharded
        self.executor = Executor(stages, schedule, {me}, recompute=recompute, pointwise=plan.pointwise_recompute,
                                 rebuilds=plan.rebuilds, early_input_grads=flags.early_input_grads,
                                 replica=mesh.data_parallel_rank, precision=precision, sharded=flags.sharded,
                                 every_microbatch=flags.every_microbatch)
        self.place = self.executor.place
        self.actions = self.executor.actions
        self.stages = self.executor.stages
        self.last_backward = self.executor.last_backward
        self.parameters = self._local_parameters()
        self.experts = flags.experts  # expert parallelism: the experts' shards sum their gradients apart
        self.expert_params = expert_parameters(s.module for s in self.stages.values()) if flags.experts else []
        self._autocast_agreed: int | None = None  # the autocast every rank last agreed on
        self._make_groups()
        self.messages = {train: self._message_order(schedule, train) for train in (True, False)}
        greet_peers(self.messages[True] + self.messages[False], me=mesh.pipeline_rank, rank=mesh.rank,
                    global_rank=mesh.global_rank, device=device, wait=self._wait)

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
        """The groups this rank's collectives use: slices of the world's mesh (one replica's
        pipeline, every replica of its stages), and one per tied weight, made in the same
        order on every rank (``new_group`` is collective)."""
        topo, D = self.topology, self.topology.data_parallel_size
        T = topo.tensor_parallel_size
        sharded = self.sharded
        self.pipeline_group = topo.pipeline_group
        self.data_parallel_group = topo.data_parallel_group
        # A weight read by stages on several ranks (a tied embedding and head): its
        # gradient is summed over exactly those ranks (of every replica).
        self.tied: list[tuple[Any, list[str]]] = []
        local = {name for name, _ in self.parameters}
        experts = {id(p) for p in self.expert_params}
        holders: dict[str, set[int]] = {}
        for s in self.plan.stages:
            for name in s.parameter_names:
                holders.setdefault(name, set()).add(self.place[s.stage_index])
        for name in sorted(holders):
            ranks = sorted(holders[name])
            if len(ranks) < 2:
                continue
            # sharded, each replica holds its shard of the weight, reduced over the replicas
            # already: the shards are summed over the ranks holding it, replica by replica
            for members in ([[topo.global_rank(r, dp, tp) for r in ranks] for dp in range(D) for tp in range(T)]
                            if sharded else
                            [[topo.global_rank(r, dp, tp) for dp in range(D) for r in ranks] for tp in range(T)]):
                group = topo.tied_group(members)
                if group is not None:
                    self.tied.append((group, [name] if name in local else []))
        self.tied_names = {n for _, names in self.tied for n in names}
        # Each stage's gradients are averaged over the replicas as its last backward finishes
        # them; a weight two local stages share goes with the one whose last backward is later.
        self.reducer: ReplicaReducer | None = None
        if self.data_parallel_group is not None and not sharded:
            owner: dict[int, int] = {}
            for k in sorted(self.stages, key=lambda k: self.last_backward[k]):
                for name, p in self.stages[k].module.named_parameters():
                    if name not in self.tied_names and p.requires_grad and id(p) not in experts:
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
        if train and self.plan.action_starts:  # ties between ranks: the action the plan says starts first
            priority = {Action.parse(a): t for names, starts in zip(self.plan.actions, self.plan.action_starts)
                        for a, t in zip(names, starts)}
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

    def _agree_on_autocast(self) -> None:
        """Ranks that exchange messages must compute in the same dtypes, or the messages' sizes
        disagree (gloo aborts the process, NCCL reads garbage). Checked with each pipeline peer
        when this rank's autocast changes (the first step; a caller's ``torch.autocast``
        entered or left), on a tag of its own so that it never matches a step's message: a
        rank that changed alone waits here for its peer and names it when it times out."""
        dtype = ambient_autocast(self.device.type)
        code = {None: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)
        if code == self._autocast_agreed:
            return
        me, names = self.topology.pipeline_rank, {0: "none", 1: "bfloat16", 2: "float16", 3: "another dtype"}
        peers = sorted({m.dest if m.source == me else m.source for m in self.messages[True] + self.messages[False]})
        for peer in peers:  # ascending, the lower rank sending first: no cycle of waits (see greet_peers)
            other = self.topology.global_rank(peer)
            mine = torch.tensor([code], dtype=torch.int64, device=self.device)
            theirs = torch.empty_like(mine)
            ops = [lambda: post(dist.isend, mine, other, tag=_AUTOCAST_TAG),
                   lambda: post(dist.irecv, theirs, other, tag=_AUTOCAST_TAG)]
            for op in ops if me < peer else ops[::-1]:
                self._wait(op(), f"rank {other}'s autocast (this rank computes under {names[code]}; a rank that "
                                   "changes its torch.autocast alone waits here)", other)
            if int(theirs.item()) != code:
                raise PipelineError(
                    f"rank {self.topology.rank} runs the step under autocast {names[code]} but rank {other}, which "
                    f"exchanges activations with it, under {names[int(theirs.item())]}: wrap every rank's "
                    "train_step / pm(...) in the same torch.autocast, or pass mixed_precision= to auto_parallel"
                )
        self._autocast_agreed = code

    def _step(self, microbatches: Sequence[tuple[Any, ...]], train: bool) -> Step:
        with autocast_for(self.device, self.executor.precision):  # the dtypes the stages will make
            self._agree_on_autocast()
            metas = [self.oracle(mb) for mb in microbatches]
        mail = Mailbox(self.messages[train], metas, me=self.topology.pipeline_rank,
                       global_rank=self.topology.global_rank, device=self.device, wait=self._wait)
        return Step(metas=metas, mail=mail)

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
        if self.reducer is not None:
            self.reducer.new_step()
        losses = self.executor.train_step(microbatches, targets, loss_fn, weights, step, self.reducer)
        assert step.mail is not None
        step.mail.finish()
        if self.reducer is not None:
            self.reducer.finish()
        if self.experts is not None:
            sync_expert_grads(self.expert_params, self.experts, self._wait)
        match_grad_placements(p for _, p in self.parameters)  # before the tied sum adds local tensors
        self._reduce_tied()
        for _, p in self.parameters:
            old = stash[id(p)]
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        total = torch.stack(losses).sum() if losses else torch.zeros(())
        total = total.to(self.device)
        work = dist.all_reduce(total, async_op=True)
        self._wait(work, "the loss all-reduce", "every rank")
        # every tensor-parallel rank of a last stage holds the same loss
        return StepResult((total / (self.topology.data_parallel_size * self.topology.tensor_parallel_size)).cpu())

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
        with timing(self.executor) as clock:
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
                grad = local_tensor(p.grad)  # sharded: this replica's shard
                work = dist.all_reduce(grad, group=group, async_op=True)
                self._wait(work, f"the all-reduce of tied weight {name!r}", "the ranks sharing it")
                if self.topology.data_parallel_size > 1 and not self.sharded:
                    p.grad /= self.topology.data_parallel_size

    def forward(self, microbatches: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Pipelined inference: the last stage's outputs, broadcast to every pipeline rank."""
        m = len(microbatches)
        step = self._step(microbatches, train=False)
        self.executor.random.new_step()
        outputs: list[Any] = [None] * m
        forwards = self._inference_actions([self.actions])[0]
        with torch.no_grad():
            for action in forwards:
                out = self.executor.forward(step, action, microbatches[action.microbatch_index], train=False)
                if self.stages[action.stage_index].is_last:
                    outputs[action.microbatch_index] = out
        assert step.mail is not None and step.metas is not None
        step.mail.finish()
        if self.sharded:  # zero2 keeps the weights gathered after a forward: shard them again, so
            for stage in self.stages.values():  # that the parameters (and their .grad) are the shards
                reshard(stage.module)
        return [self._broadcast_output(outputs[i], step.metas[i]["output"]) for i in range(m)]

    def _broadcast_output(self, out: Any, meta_out: Any) -> Any:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        last = self.topology.global_rank(self.place[self.plan.num_stages - 1])
        leaves, spec = tree_flatten(meta_out)
        mine = tree_flatten(out)[0] if out is not None else None
        result = []
        for n, leaf in enumerate(leaves):
            if leaf is DATA_DEPENDENT:  # a Python value only the last rank knows
                box = [mine[n] if mine is not None else None]
                dist.broadcast_object_list(box, last, group=self.pipeline_group)
                result.append(box[0])
                continue
            if not isinstance(leaf, TensorMeta):
                result.append(mine[n] if mine is not None else leaf)
                continue
            shape = leaf.shape
            if leaf.dynamic:  # its size depends on the data: the last rank says it first
                size = torch.tensor(mine[n].shape if mine is not None else [0] * len(shape), dtype=torch.int64,
                                    device=self.device)
                self._wait(dist.broadcast(size, last, group=self.pipeline_group, async_op=True),
                           "the output's shape broadcast", last)
                shape = tuple(size.tolist())
            buf = mine[n].contiguous() if mine is not None else leaf.empty(self.device, shape)
            work = dist.broadcast(buf, last, group=self.pipeline_group, async_op=True)
            self._wait(work, "the output broadcast", last)
            result.append(buf)
        return tree_unflatten(result, spec)

