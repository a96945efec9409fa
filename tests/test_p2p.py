"""The agreed message order that NCCL needs: every schedule, chains and long skips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.errors import ScheduleError
from replica.runtime.mailbox import Mailbox
from replica.runtime.p2p import BWD, FWD, check_fifo, linearize, ordered, step_messages
from replica.schedules.schedule import INTERLEAVED, SCHEDULES, V_SHAPED, make_schedule, placement


def chain(num_stages: int) -> list[tuple[str, int, int]]:
    return [(f"x{s}", s, s + 1) for s in range(num_stages - 1)]


def skips(num_stages: int) -> list[tuple[str, int, int]]:
    """A U-Net (every stage's output also goes to its mirror stage) whose first stage also
    feeds every later one: under V placement the mirrors share a rank, these do not."""
    edges = chain(num_stages)
    edges += [(f"x{s}", s, num_stages - 1 - s) for s in range(num_stages // 2 - 1)]
    edges += [("ids", 0, d) for d in range(2, num_stages)]
    return edges


def layouts():
    for name in SCHEDULES:
        for p in (2, 3, 4):
            yield name, p, p
    for name in INTERLEAVED:
        for p in (2, 3):
            yield name, 2 * p, p
    for name in V_SHAPED:
        for p in (2, 3):
            yield name, 2 * p, p


@pytest.mark.parametrize("name,num_stages,num_ranks", list(layouts()))
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("edges", [chain, skips])
def test_ordered_messages_never_hang_under_nccl_rules(name, num_stages, num_ranks, m, edges):
    m = m * num_ranks if name in INTERLEAVED else m  # interleaving needs a multiple of the ranks
    schedule = make_schedule(name, num_stages, m, num_ranks)
    where = placement(schedule)
    messages = step_messages(edges(num_stages), where, m, train=True)
    check_fifo(schedule, ordered(messages, linearize(schedule, messages)))


@pytest.mark.parametrize("name,num_stages,num_ranks", list(layouts()))
def test_inference_order_never_hangs(name, num_stages, num_ranks):
    """pm(x) runs each rank's forwards micro-batch by micro-batch: its own order, checked too."""
    m = 2 * num_ranks
    schedule = make_schedule(name, num_stages, m, num_ranks)
    forwards = [sorted((a for a in actions if a.kind == "F"), key=lambda a: (a.microbatch_index, a.stage_index))
                for actions in schedule]
    messages = step_messages(skips(num_stages), placement(schedule), m, train=False)
    check_fifo(forwards, ordered(messages, linearize(forwards, messages)))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(list(layouts())), st.data())
def test_any_subset_of_an_agreed_order_never_hangs(layout, data):
    """A step posts only tensors (and gradients only of those that need one): any subset of
    the agreed list, kept in order, must still be safe."""
    name, num_stages, num_ranks = layout
    m = 2 * num_ranks
    schedule = make_schedule(name, num_stages, m, num_ranks)
    messages = step_messages(skips(num_stages), placement(schedule), m, train=True)
    full = ordered(messages, linearize(schedule, messages))
    keep = data.draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
    check_fifo(schedule, [msg for msg, k in zip(full, keep) if k])


def test_messages_of_a_step():
    where = {0: 0, 1: 1, 2: 1}
    messages = step_messages([("a", 0, 1), ("b", 1, 2), ("c", 0, 2)], where, 2, train=True)
    keys = {msg.key for msg in messages}
    assert keys == {(n, r, i, d) for n, r in (("a", 1), ("c", 2)) for i in range(2) for d in (FWD, BWD)}
    back = next(msg for msg in messages if msg.key == ("c", 2, 1, BWD))
    assert (str(back.producer), str(back.consumer), back.source, back.dest) == ("2B1", "0B1", 1, 0)
    assert all(msg.direction == FWD for msg in step_messages([("a", 0, 1)], where, 2, train=False))


def test_up_front_receives_would_hang():
    """Both ranks posting every receive before any send: NCCL's FIFO streams deadlock."""
    schedule = make_schedule("1f1b", 2, 4)
    messages = step_messages(chain(2), placement(schedule), 4, train=True)
    order = linearize(schedule, messages)
    # receives-first on both sides cannot be one agreed list; the closest agreed list that
    # puts gradients (rank 0's receives) before activations hangs the same way
    grads_first = sorted(messages, key=lambda msg: (msg.direction != BWD, order[msg.producer]))
    with pytest.raises(ScheduleError, match="would hang under NCCL"):
        check_fifo(schedule, grads_first)


def test_a_reversed_order_hangs():
    schedule = make_schedule("1f1b", 2, 2)
    messages = step_messages(chain(2), placement(schedule), 2, train=True)
    good = ordered(messages, linearize(schedule, messages))
    check_fifo(schedule, good)
    with pytest.raises(ScheduleError, match="rank 0 at 0B0, rank 1 at 1F0"):
        check_fifo(schedule, good[::-1])


def test_linearize_respects_ranks_and_messages():
    schedule = make_schedule("zb-v", 4, 6)
    messages = step_messages(skips(4), placement(schedule), 6, train=True)
    order = linearize(schedule, messages, priority={a: -k for k, a in enumerate(schedule[1])})
    for actions in schedule:
        assert [order[a] for a in actions] == sorted(order[a] for a in actions)
    assert all(order[msg.producer] < order[msg.consumer] for msg in messages)


def test_a_cycle_is_refused():
    schedule = make_schedule("1f1b", 2, 2)
    messages = step_messages(chain(2), placement(schedule), 2, train=True)
    swapped = [list(reversed(schedule[0])), list(schedule[1])]
    with pytest.raises(ScheduleError, match="cycle"):
        linearize(swapped, messages)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(layouts())), st.integers(1, 12), st.data())
def test_random_priorities_still_agree(layout, m, data):
    """Any tie-breaking gives an order that cannot hang: the priorities only pick among valid ones."""
    name, num_stages, num_ranks = layout
    m = m * num_ranks if name in INTERLEAVED else m
    schedule = make_schedule(name, num_stages, m, num_ranks)
    messages = step_messages(skips(num_stages), placement(schedule), m, train=True)
    actions = [a for rank in schedule for a in rank]
    priority = dict(zip(actions, data.draw(st.lists(st.floats(0, 1), min_size=len(actions), max_size=len(actions)))))
    check_fifo(schedule, ordered(messages, linearize(schedule, messages, priority)))


def test_mailbox_posts_in_the_pair_order_whatever_the_environment(monkeypatch):
    """Rank 1 of a 2-stage 1F1B step posts its first receive at once and the rest in the
    pair's order, each when the send before it went out, every tag 0: NCCL's matching. The
    old ``REPLICA_P2P=eager`` switch (every receive up front, by tag) is gone."""
    from replica.runtime import mailbox
    from replica.runtime.shapes import TensorMeta

    monkeypatch.setenv("REPLICA_P2P", "eager")  # ignored now
    posted: list[tuple[str, tuple, int]] = []

    def post(kind):
        def op(tensor, peer, tag=0, **_):
            posted.append((kind, peer, tag))
            return _Work(True)
        return op

    monkeypatch.setattr(mailbox.dist, "irecv", post("recv"))
    monkeypatch.setattr(mailbox.dist, "isend", post("send"))
    schedule = make_schedule("1f1b", 2, 3)
    messages = ordered(step_messages(chain(2), placement(schedule), 3, train=True),
                       linearize(schedule, step_messages(chain(2), placement(schedule), 3, train=True)))
    metas = [{"x0": TensorMeta((2,), torch.float32, True)} for _ in range(3)]
    mail = Mailbox(messages, metas, me=1, global_rank=lambda r: r, device=torch.device("cpu"),
                   wait=lambda work, what, peer: work.wait())
    mine = [(m.key, m.dest == 1) for m in messages]
    first_send = [r for _, r in mine].index(False)
    assert first_send == 2  # 1F1B: rank 0 runs F0 F1 before its first backward
    assert posted == [("recv", 0, 0)] * first_send  # posting stops at a send whose value is not made yet
    for key, receiving in mine:
        if receiving:
            mail.receive(key, "activation")
        else:
            mail.send(key, torch.zeros(2))
    mail.finish()
    assert [kind for kind, _, _ in posted] == ["recv" if r else "send" for _, r in mine]
    assert {(peer, tag) for _, peer, tag in posted} == {(0, 0)}


def test_pair_digest_tells_orders_apart():
    from replica.runtime.mailbox import digest as _digest

    schedule = make_schedule("1f1b", 2, 3)
    messages = ordered(step_messages(chain(2), placement(schedule), 3, train=True),
                       linearize(schedule, step_messages(chain(2), placement(schedule), 3, train=True)))
    assert _digest(messages) == _digest(list(messages))
    assert _digest(messages) != _digest(messages[1:] + messages[:1])
    assert 0 <= _digest(messages) < 2**63


class _Work:
    """A stand-in for a send's work: done or not, and failed or not."""

    def __init__(self, done: bool, error: str = "") -> None:
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


def _mailbox(waited: list) -> Mailbox:
    def wait(work, what, peer):
        waited.append(what)
        work.wait()

    return Mailbox([], [], me=0, global_rank=lambda r: r, device=torch.device("cpu"), wait=wait)


def test_a_finished_send_lets_go_of_its_payload():
    """A payload is dropped once its send is done (a gradient sent upstream is read by nobody
    here), not kept to the step's end; an unfinished one stays until finish()."""
    waited: list[str] = []
    mail = _mailbox(waited)
    mail.sends[("a", 0, 0, BWD)] = (_Work(True), torch.zeros(4), "sending 'a' of micro-batch 0", 1)
    mail.sends[("a", 0, 1, BWD)] = (_Work(False), torch.zeros(4), "sending 'a' of micro-batch 1", 1)
    mail._release()
    assert list(mail.sends) == [("a", 0, 1, BWD)]
    assert waited == ["sending 'a' of micro-batch 0"]
    mail.finish()
    assert not mail.sends


def test_a_failed_send_is_reported_when_released():
    mail = _mailbox([])
    mail.sends[("a", 0, 0, BWD)] = (_Work(True, "connection closed"), torch.zeros(4), "sending 'a'", 1)
    with pytest.raises(RuntimeError, match="connection closed"):
        mail._release()
