"""Parameters and buffers no op reads (a ViT's ``mask_token``) still belong to the graph and a stage."""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["hold_tensor", "hold_unused", "rebind_tensors"]


def hold_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor, persistent: bool = True) -> None:
    """Put ``tensor`` at dotted ``name`` under ``root`` (a parameter stays one), adding an empty
    module for each missing level, unless ``root`` reaches a tensor under that name already."""
    *path, field = name.split(".")
    owner = root
    for part in path:
        child = getattr(owner, part, None)
        if not isinstance(child, torch.nn.Module):
            child = torch.nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(getattr(owner, field, None), torch.Tensor):
        return
    if isinstance(tensor, torch.nn.Parameter):
        owner.register_parameter(field, tensor)
    else:
        owner.register_buffer(field, tensor, persistent=persistent)


def hold_unused(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """fx keeps only the weights the forward reads; the graph module holds the others too (a
    ViT's ``mask_token``, used only when masks are passed), so that a stage can own them."""
    held = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    owners = dict(model.named_modules())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in held:
            module, _, field = name.rpartition(".")
            hold_tensor(gm, name, t, field not in owners[module]._non_persistent_buffers_set)
            held.add(id(t))


def rebind_tensors(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Point ``gm`` at ``model``'s current tensors, by name. After a meta model's tensors were
    materialized (new objects in its modules' ``_parameters`` and ``_buffers``), those a graph
    module holds itself (every weight of an exported graph, ``get_attr`` targets) are the stale
    meta ones; sub-modules an fx graph calls are the model's own objects, up to date already."""
    current = dict(model.named_parameters(remove_duplicate=False))
    current.update(model.named_buffers(remove_duplicate=False))
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        new = current.get(name)
        if new is None or new is t:
            continue
        path, _, field = name.rpartition(".")
        owner = gm.get_submodule(path)
        getattr(owner, "_parameters" if field in owner._parameters else "_buffers")[field] = new
