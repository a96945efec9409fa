"""Planning leaves the user's model as it found it: buffers, parameters, RNG and modes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.fx as fx

from replica.partition.mutation import mutates_first_argument

__all__ = ["untouched", "written_parameters"]


def _real(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and type(t).__name__ != "FakeTensor"


def written_parameters(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters ``gm`` writes into in place (a forward that clamps its own weight):
    the only ones worth a copy before running it, the others are only read."""
    out = []
    for n in gm.graph.nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if first is not None and first.op == "get_attr" and mutates_first_argument(n, gm):
            value = gm
            for part in str(first.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.nn.Parameter):
                out.append(value)
    return out


@contextmanager
def untouched(module: torch.nn.Module, parameters: Iterable[torch.Tensor] = ()) -> Iterator[None]:
    """Within, ``module`` may be run (traced, profiled, its shapes propagated); on leaving,
    its buffers (a BatchNorm's running statistics and batch count), the given
    ``parameters``, torch's random generators (CPU, and every CUDA device once CUDA is up)
    and every sub-module's ``training`` flag are as they were on entering.

    Buffers are copied (they are small: statistics, masks, position tables); parameters are
    not, unless named: reading them changes nothing and copying them would double a model's
    memory. A value is written back only if it changed, so a buffer nobody wrote keeps its
    storage untouched."""
    buffers = [(b, b.clone()) for b in module.buffers() if _real(b)]
    params = [(p, p.detach().clone()) for p in dict.fromkeys(parameters) if _real(p)]
    modes = [(m, m.training) for m in module.modules()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, before in [*buffers, *params]:
                if t.shape != before.shape:  # resized in place (a cache that grew)
                    t.data = before
                elif not torch.equal(t, before):
                    t.copy_(before)
        for m, training in modes:
            m.training = training
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
