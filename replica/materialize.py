"""Real storage and layout-independent initialization for a model built on the meta device."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from replica.errors import ConfigError

__all__ = ["deferred_init", "materialize", "materialize_modules"]

Init = Callable[[nn.Module], None]
_KINDS = ("_parameters", "_buffers")
_FIX_BUFFERS = (
    "a model built under torch.device('meta') loses what its __init__ computed into buffers "
    "(causal masks, rotary inv_freq, position ids); build it under "
    "`with replica.deferred_init():` instead (parameters on meta, buffers real), "
    "or pass init= a function that sets them"
)


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build models whose parameters land on meta while their buffers stay real (on CPU).

    ``nn.Module.register_parameter`` is patched for the duration of the block (not
    thread-safe): each parameter moves to meta as it is registered, so a constructor's own
    init runs on meta and costs nothing, while buffers keep the values ``__init__`` computed.
    A parameter holds CPU memory only between its creation and its registration.
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            param = moved
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(
    model: nn.Module,
    init: Init | None = None,
    weights: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    *,
    seed: int | None = None,
) -> nn.Module:
    """Give every meta tensor of ``model`` storage on ``device`` (cpu) and initialize it, in place;
    with ``weights`` (a ``.safetensors`` file, a Hugging Face directory or a Replica
    checkpoint, :func:`replica.weights.read_weights`) every saved tensor is then loaded by name.

    Equivalent to :func:`materialize_modules` over every module that directly owns a tensor,
    so the weights equal those of any split of the modules under the same ``seed``
    (``None``: one 62-bit draw from torch's default generator). A model without any meta
    tensor is a ConfigError: returning it silently would skip ``init``.
    """
    paths = [path for path, module in model.named_modules() if _direct(module)]
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ConfigError(
            f"materialize: {type(model).__name__} has no tensor on the meta device, so there is "
            f"nothing to materialize; build it under `with torch.device('meta'):` or "
            f"`with replica.deferred_init():`, or drop the materialize call"
        )
    if seed is None:
        seed = int(torch.randint(2**62, (), device="cpu").item())
    materialize_modules(model, paths, init, device, seed=seed, weights=weights)
    return model


def materialize_modules(
    model: nn.Module,
    module_paths: Iterable[str],
    init: Init | None = None,
    device: str | torch.device | None = None,
    *,
    seed: int,
    weights: str | os.PathLike[str] | None = None,
) -> None:
    """Materialize only the modules at ``module_paths`` and the tensors they directly own.

    What a pipeline rank does for its own stages; every other tensor stays on meta. Each
    module with a meta tensor is initialized under its own RNG seed, a hash of
    ``f"{seed}:{path}"`` (global RNG state restored after), by its ``reset_parameters()`` (or
    ``_reset_parameters()``) when it has one, then by ``init(module)`` when given; modules run
    in ``model.apply`` order (children before parents). So the weights do not depend on how
    the paths are grouped, as long as an ``init`` that writes into a child module's tensors
    (HF GPT-2's scaled ``c_proj`` from the attention module) runs with that child; a parent
    that owns no tensor itself is never visited. A tensor shared by several modules (tied
    embedding and LM head) is allocated once, replaced in every owner model-wide, and takes
    the value its first owner in ``named_modules()`` order gives it. Tensors these modules
    already hold for real move to ``device``. Bitwise equality holds on one device type.
    With ``weights`` the new tensors that ``state_dict`` saves are then read from there by
    name (only theirs; tied ones from any stored partner), and ``init`` may be None for
    modules without ``reset_parameters``: the file sets their parameters.
    """
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "meta":
        raise ConfigError("materialize: device='meta' allocates nothing; pass 'cpu', 'cuda', ...")
    modules = dict(model.named_modules())
    wanted = list(dict.fromkeys(module_paths))
    _check_paths(model, modules, wanted)
    path_of = {id(m): p for p, m in modules.items()}
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}  # tensor -> (module, kind, name)
    first_owner: dict[int, nn.Module] = {}  # tensor -> its first owner in named_modules order
    for module in modules.values():
        for kind, name, t in _direct(module):
            owners.setdefault(id(t), []).append((module, kind, name))
            first_owner.setdefault(id(t), module)
    selected = {id(modules[p]): modules[p] for p in wanted}
    todo = {k: m for k, m in selected.items() if any(t.is_meta for _, _, t in _direct(m))}
    extras: dict[int, nn.Module] = {}  # first owners of meta tensors that `todo` shares but does not hold
    for module in todo.values():
        for _, _, t in _direct(module):
            owner = first_owner[id(t)]
            if t.is_meta and id(owner) not in todo:
                extras[id(owner)] = owner
    run = {**todo, **extras}
    if init is None and weights is None:
        _require_reset_parameters(run.values(), path_of)

    created: dict[int, tuple[Tensor, Tensor, int]] = {}  # id(new) -> (new, original, version)
    replaced: list[Tensor] = []  # keeps replaced tensors alive, so no id is reused
    for group, wanted_meta in ((run, True), (selected, False)):  # allocate, then move real ones
        for module in group.values():
            for _, _, t in _direct(module):
                if t.is_meta == wanted_meta and t.device != dev:
                    new = _allocate(t, dev) if wanted_meta else _moved(t, dev)
                    _replace(owners[id(t)], new)
                    owners[id(new)], first_owner[id(new)] = owners[id(t)], first_owner[id(t)]
                    if wanted_meta:
                        created[id(new)] = (new, t, new._version)
                    replaced.append(t)

    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in run and id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    model.apply(visit)
    for module in order:
        _initialize(module, init, _module_seed(seed, path_of[id(module)]), dev, first_owner)

    held = {id(t) for m in selected.values() for _, _, t in _direct(m)}
    for module in extras.values():  # back to meta: what they hold for the tie only
        for _, _, t in _direct(module):
            if id(t) in created and id(t) not in held:
                original = created[id(t)][1]
                _replace(owners[id(original)], original)
    if weights is not None:
        _load(weights, todo.values(), created, path_of)
    _check_initialized(todo.values(), created, path_of, init)


def _load(weights: str | os.PathLike[str], modules: Iterable[nn.Module], created: dict[int, tuple[Tensor, Tensor, int]],
          path_of: dict[int, str]) -> None:
    """Fill the new tensors of ``modules`` that a state_dict saves from ``weights``, by name."""
    from replica.weights import read_weights  # safetensors only where weights are loaded

    names: dict[int, list[str]] = {}  # tensor -> its state_dict names, first owner first
    tensors: dict[int, Tensor] = {}
    for module in modules:
        prefix = f"{path_of[id(module)]}." if path_of[id(module)] else ""
        for kind, name, t in _direct(module):
            if id(t) in created and not (kind == "_buffers" and name in module._non_persistent_buffers_set):
                names.setdefault(id(t), []).append(prefix + name)
                tensors[id(t)] = t
    wanted = {group[0]: (tuple(tensors[k].shape), tensors[k].dtype) for k, group in names.items()}
    aliases = {group[0]: tuple(group[1:]) for group in names.values() if len(group) > 1}
    fix = (f"Check that {weights} holds this model's weights, written for the same config (tied weights are "
           "matched already): a different model or size cannot load them.")
    loaded = read_weights(weights, wanted, aliases=aliases, device=next(iter(tensors.values())).device, fix=fix) \
        if wanted else {}
    with torch.no_grad():
        for k, group in names.items():
            tensors[k].copy_(loaded[group[0]])


def _check_paths(model: nn.Module, modules: dict[str, nn.Module], wanted: list[str]) -> None:
    """Every path names a module that owns a tensor itself."""
    for path in wanted:
        if path not in modules:
            close = [p for p in modules if p and p.rpartition('.')[0] == path.rpartition('.')[0]][:8]
            raise ConfigError(f"materialize: {type(model).__name__} has no module {path!r}; near it: {close}")
        if not _direct(modules[path]):
            owners = [p for p in modules if p.startswith(f'{path}.' if path else '') and _direct(modules[p])][:5]
            raise ConfigError(
                f"materialize: module {path!r} ({type(modules[path]).__name__}) owns no parameter or "
                f"buffer itself; pass the paths of the modules that do, e.g. {owners}"
            )


def _direct(module: nn.Module) -> list[tuple[str, str, Tensor]]:
    """(kind, name, tensor) for each parameter and buffer the module owns itself."""
    return [
        (kind, name, t) for kind in _KINDS for name, t in getattr(module, kind).items() if t is not None
    ]


def _module_seed(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little") >> 1


def _fill_value(t: Tensor) -> float | int | bool:
    """A value no initializer leaves behind: NaN for floats, the largest value otherwise."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    return True if t.dtype == torch.bool else int(torch.iinfo(t.dtype).max)


def _allocate(t: Tensor, device: torch.device) -> Tensor:
    new = torch.empty_like(t, device=device).fill_(_fill_value(t))
    if isinstance(t, nn.Parameter):
        param = nn.Parameter(new, requires_grad=t.requires_grad)
        param.__dict__.update(t.__dict__)
        return param
    return new


def _moved(t: Tensor, device: torch.device) -> Tensor:
    if isinstance(t, nn.Parameter):
        t.data = t.data.to(device)
        return t
    return t.to(device)


def _replace(places: list[tuple[nn.Module, str, str]], new: Tensor) -> None:
    for module, kind, name in places:
        getattr(module, kind)[name] = new


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run under ``seed`` on the CPU generator and ``device``'s, restoring both after."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[], device_type="cpu"):
            torch.default_generator.manual_seed(seed)
            yield
        return
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.default_generator.manual_seed(seed)
        with backend.device(index):
            backend.manual_seed(seed)
        yield


def _initialize(
    module: nn.Module, init: Init | None, seed: int, device: torch.device, first_owner: dict[int, nn.Module]
) -> None:
    """One module's init under its own seed; tensors another module owns first keep their value."""
    shared = [(t, t.detach().clone(), t._version) for _, _, t in _direct(module) if first_owner[id(t)] is not module]
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    with _seeded(seed, device), torch.no_grad():
        if callable(reset):
            reset()
        if init is not None:
            init(module)
        for t, saved, version in shared:
            if t._version != version:
                t.copy_(saved)


def check_initializable(model: nn.Module) -> None:
    """Raise before any work if ``init=None`` could not initialize ``model``: a module that
    owns meta parameters but has no ``reset_parameters()``."""
    path_of = {id(m): p for p, m in model.named_modules()}
    _require_reset_parameters([m for m in model.modules() if any(t.is_meta for t in m._parameters.values()
                                                                   if t is not None)], path_of)


def _require_reset_parameters(modules: Iterable[nn.Module], path_of: dict[int, str]) -> None:
    missing = [
        f"{path_of[id(m)] or '<root>'} ({type(m).__name__})"
        for m in modules
        if m._parameters and not any(hasattr(m, n) for n in ("reset_parameters", "_reset_parameters"))
    ]
    if missing:
        raise ConfigError(
            f"materialize: init=None calls each module's reset_parameters(), but {len(missing)} "
            f"module(s) own parameters without one: {', '.join(missing[:8])}; pass init= a function "
            f"applied to each module, e.g. the model's own (init=model._init_weights for HF models)"
        )


def _check_initialized(
    modules: Iterable[nn.Module],
    created: dict[int, tuple[Tensor, Tensor, int]],
    path_of: dict[int, str],
    init: Init | None,
) -> None:
    """Raise if a tensor still holds its fill value: NaN left in a float, or an untouched int."""
    stale: dict[str, list[str]] = {"_parameters": [], "_buffers": []}
    checked: set[int] = set()
    for module in modules:
        for kind, name, t in _direct(module):
            if id(t) not in created or id(t) in checked:
                continue
            checked.add(id(t))
            version = created[id(t)][2]
            if t.is_floating_point() or t.is_complex():
                bad = bool(torch.isnan(t.detach()).any())
            else:
                bad = t._version == version and bool((t.detach() == _fill_value(t)).all())
            if bad:
                path = path_of[id(module)]
                stale[kind].append(f"{path + '.' if path else ''}{name} ({type(module).__name__})")
    problems = []
    if stale["_buffers"]:
        problems.append(f"buffers {', '.join(stale['_buffers'][:8])} were not recomputed: {_FIX_BUFFERS}")
    if stale["_parameters"]:
        by = "reset_parameters()" if init is None else "reset_parameters() or init"
        problems.append(
            f"parameters {', '.join(stale['_parameters'][:8])} were left unset by {by}: make init set them"
        )
    if problems:
        count = len(stale["_buffers"]) + len(stale["_parameters"])
        raise ConfigError(f"materialize: {count} tensor(s) hold no value after init; " + "; ".join(problems))
