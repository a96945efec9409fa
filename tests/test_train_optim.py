"""The optimizer rebuilt for one rank's parameters keeps its class, defaults, groups and state; state by name."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.train.optim import load_state_by_name, make_optimizer, rebuild_optimizer, state_by_name


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def names(m: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in m.named_parameters()}


def step(opt: torch.optim.Optimizer, m: torch.nn.Module) -> None:
    m(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.5, "momentum": 0.9},
                               {"params": [*m[2].parameters(), *m[3].parameters()], "weight_decay": 1e-3}],
                              lr=0.1, nesterov=False),
    lambda m: torch.optim.AdamW([{"params": m[0].parameters()},
                                 {"params": [*m[2].parameters(), *m[3].parameters()], "lr": 3e-4,
                                  "betas": (0.8, 0.95)}], lr=1e-3, weight_decay=0.1),
    lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, alpha=0.9, centered=True),
])
def test_a_stage_gets_its_parameters_with_their_groups_hyper_parameters(make) -> None:
    m = model()
    opt = make(m)
    step(opt, m)
    held = {n: p for n, p in m.named_parameters() if not n.startswith("0.")}  # a "stage" without layer 0
    stage = rebuild_optimizer(opt, names(m), held)
    assert type(stage) is type(opt) and stage.defaults == opt.defaults
    kept = [g for g in opt.param_groups if any(id(p) in {id(q) for q in held.values()} for p in g["params"])]
    assert len(stage.param_groups) == len(kept)
    for new, old in zip(stage.param_groups, kept):
        assert {k: v for k, v in new.items() if k != "params"} == {k: v for k, v in old.items() if k != "params"}
        assert [id(p) for p in new["params"]] == [id(p) for p in old["params"] if id(p) in {id(q) for q in held.values()}]
    carried = [p for p in held.values() if p in opt.state]  # state built before the rebuild carries over
    assert carried or isinstance(opt, torch.optim.SGD)
    for p in carried:
        assert stage.state[p] is opt.state[p]


def test_a_rank_without_any_of_the_parameters_gets_none() -> None:
    m = model()
    assert rebuild_optimizer(torch.optim.SGD(m[0].parameters(), lr=0.1), names(m), {"2.weight": m[2].weight}) is None


def test_the_users_optimizer_is_kept_when_it_covers_this_rank_and_a_factory_is_called() -> None:
    m = model()
    opt = torch.optim.Adam(m.parameters())
    held = dict(m.named_parameters())
    assert make_optimizer(opt, names(m), held) is opt
    made = make_optimizer(lambda params: torch.optim.SGD(params, lr=0.2), names(m), held)
    assert isinstance(made, torch.optim.SGD) and made.defaults["lr"] == 0.2
    with pytest.raises(replica.ConfigError, match="must return a torch.optim.Optimizer"):
        make_optimizer(lambda params: "adam", names(m), held)


def test_a_tensor_outside_the_model_is_refused() -> None:
    m = model()
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(replica.ConfigError, match=r"shape \(3,\) that is not a parameter of the model"):
        rebuild_optimizer(torch.optim.SGD([stray, *m.parameters()], lr=0.1), names(m), dict(m.named_parameters()))


def test_state_saved_by_two_ranks_loads_into_one() -> None:
    m = model()
    full = torch.optim.Adam([{"params": m[0].parameters(), "lr": 0.01}, {"params": [*m[2].parameters(),
                             *m[3].parameters()], "lr": 0.002}])
    step(full, m)
    ranks = [{n: p for n, p in m.named_parameters() if n.startswith(("0.", "2."))},
             {n: p for n, p in m.named_parameters() if n.startswith("3.")}]
    saved = [state_by_name(rebuild_optimizer(full, names(m), r), names(m)) for r in ranks]
    assert set(saved[1]["state"]) == {"3.weight", "3.bias"}

    fresh = torch.optim.Adam([{"params": m[0].parameters(), "lr": 1.0}, {"params": [*m[2].parameters(),
                              *m[3].parameters()], "lr": 1.0}])
    load_state_by_name(fresh, saved, names(m))
    assert [g["lr"] for g in fresh.param_groups] == [0.01, 0.002]
    for p in m.parameters():
        for key, value in full.state[p].items():
            torch.testing.assert_close(fresh.state[p][key], value)
