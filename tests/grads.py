"""The transparency check every test shares: a wrapped model's gradients equal the plain model's."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["whole", "assert_same_grads"]

Named = Any  # a module, a PipelineModel, {name: parameter} or (name, parameter) pairs


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as the plain model would hold it: a DTensor (TP or FSDP2 shard) gathered whole."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _named(params: Named) -> dict[str, torch.Tensor]:
    if hasattr(params, "named_parameters"):  # a module or a PipelineModel
        return dict(params.named_parameters())
    if isinstance(params, Mapping):
        return dict(params)
    return dict(params)


def assert_same_grads(got: Named, want: Named, *, subset: bool = False, weights: bool = False,
                      context: str = "", **tol: float) -> list[str]:
    """Every parameter of ``got`` (a ``PipelineModel``, a module, or ``{name: parameter}``) has the
    gradient of ``want``'s parameter of the same name (DTensors compared whole), to ``tol``
    (``rtol`` / ``atol`` of ``torch.testing.assert_close``; its dtype's defaults otherwise).

    ``subset``: ``got`` may hold only some of ``want``'s parameters (a rank holding its stages);
    otherwise both hold the same names. A parameter whose reference gradient is None must have
    none either. ``weights``: the parameters themselves must also be equal, bit for bit.
    Returns the names compared (what a rank held)."""
    mine, ref = _named(got), _named(want)
    if subset:
        extra = sorted(set(mine) - set(ref))
        assert not extra, f"{context}parameters the plain model does not have: {extra}"
    else:
        assert sorted(mine) == sorted(ref), \
            f"{context}parameter names differ: only wrapped {sorted(set(mine) - set(ref))}, " \
            f"only plain {sorted(set(ref) - set(mine))}"
    for name, p in mine.items():
        if weights:
            torch.testing.assert_close(whole(p), ref[name].detach(), rtol=0, atol=0,
                                       msg=lambda m, name=name: f"{context}{name} (weight): {m}")
        expected = ref[name].grad
        if expected is None:
            assert p.grad is None, f"{context}{name} has a gradient the plain model does not"
            continue
        assert p.grad is not None, f"{context}{name} has no gradient"
        torch.testing.assert_close(whole(p.grad), expected, **tol,
                                   msg=lambda m, name=name: f"{context}{name}: {m}")
    return sorted(mine)
