"""The torch.export path: models torch.fx cannot trace still split, with exact gradients."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replica
from replica.partition.trace import trace
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads
from tests.models import tiny_gpt


class ShapeBranch(nn.Module):
    """A Python branch on a shape: fx cannot trace it, export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(16))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)  # (B, T, 16)
        if x.shape[-1] == 16:
            x = x * self.scale
        h = x + torch.relu(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        return {"logits": self.head(h), "hidden": h}


def dict_loss(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # depends on values: neither tracer can capture it
            return self.l(x)
        return -self.l(x)


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (n, 6), generator=g), torch.randint(0, 32, (n, 6), generator=g)


def test_auto_falls_back_to_export():
    ids, _ = batch()
    traced = trace(ShapeBranch(), (ids,))
    assert traced.tracer == "export"
    assert {"embed.weight", "l1.weight", "l2.bias", "scale"} <= set(traced.graph.parameters)
    assert traced.graph.parameters["embed.weight"].aliases == ("head.weight",)
    assert any(n.module_path == "l1" for n in traced.graph.op_nodes)


def test_fx_only_raises_with_the_fix():
    ids, _ = batch()
    with pytest.raises(replica.TraceError, match="torch.fx could not trace"):
        trace(ShapeBranch(), (ids,), tracer="fx")


def test_neither_tracer_names_both_reasons():
    with pytest.raises(replica.TraceError) as err:
        trace(DataDependent(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "torch.fx:" in message and "torch.export:" in message and "Fix:" in message


def test_unknown_tracer():
    with pytest.raises(replica.ConfigError, match="tracer must be"):
        trace(ShapeBranch(), batch()[:1], tracer="jit")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_exported_models_train_exactly(schedule, num_stages):
    torch.manual_seed(0)
    model = ShapeBranch()
    ref = copy.deepcopy(model)
    ids, target = batch()
    ref_loss = dict_loss(ref(ids), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, (ids,), num_stages=num_stages, num_microbatches=3, schedule=schedule,
                               loss_fn=dict_loss, device=COMPUTE_BOUND)
    torch.testing.assert_close(pm.train_step(ids, target), ref_loss.detach())
    assert_same_grads(pm, ref)
    with torch.no_grad():
        out = pm(ids)  # the model's own output type: a dict, re-assembled from micro-batches
        torch.testing.assert_close(out["logits"], ref(ids)["logits"])


# --------------------------------------------------------------------------- dynamic dims


class ImageBranch(nn.Module):
    """An image model fx cannot trace (a branch on the width); export keeps its sides fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 5)
        if x.shape[-1] % 4:
            x = F.pad(x, (0, 4 - x.shape[-1] % 4))
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.head(h.mean((2, 3)))


def test_images_export_with_only_the_batch_dynamic_and_train_exactly():
    model, x, y = ImageBranch(), torch.randn(8, 3, 8, 8), torch.randn(8, 5)
    traced = trace(model, (x,))
    assert traced.tracer == "export" and traced.dynamic_dims == ((0,),)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, device=COMPUTE_BOUND,
                               loss_fn=F.mse_loss)
    pm.train_step((x,), y)
    assert_same_grads(pm, ref)
    with torch.no_grad():
        torch.testing.assert_close(pm(x[:4]), ref(x[:4]))  # another batch size: dynamic
    with pytest.raises(replica.ConfigError, match=r"size 12 in dimension 3.*fixed that dimension at 8.*"
                                                  r"dynamic_dims='all'"):
        pm(torch.randn(8, 3, 8, 12))


def test_all_dynamic_dims_keep_an_image_s_sides_dynamic():
    model, x = ImageBranch(), torch.randn(8, 3, 8, 8)
    traced = trace(model, (x,), dynamic_dims="all")
    assert traced.dynamic_dims == ((0, 2),) or traced.dynamic_dims == ((0, 2, 3),)  # the width may be specialised


def test_token_ids_keep_their_length_dynamic():
    ids, _ = batch()
    traced = trace(ShapeBranch(), (ids,))
    assert traced.dynamic_dims == ((0, 1),)
    assert trace(ShapeBranch(), (ids,), dynamic_dims="batch").dynamic_dims == ((0,),)


def test_unknown_dynamic_dims_names_the_choices():
    ids, _ = batch()
    with pytest.raises(replica.ConfigError, match=r"dynamic_dims must be 'auto'.*'batch'.*'all'"):
        trace(ShapeBranch(), (ids,), dynamic_dims="seq")


def test_plan_records_dynamic_dims_in_json_and_summary():
    import dataclasses

    ids, _ = batch()
    plan = replica.plan(ShapeBranch(), (ids,), num_stages=2, device=COMPUTE_BOUND)
    plan = dataclasses.replace(plan, dynamic_dims=((0, 1),))
    again = replica.Plan.from_json(plan.to_json())
    assert again.dynamic_dims == ((0, 1),)
    assert "dynamic dims per input (others fixed by torch.export): input 0: 0, 1" in again.summary()
    model, inputs, _, _ = tiny_gpt(8)
    fx_plan = replica.plan(model, inputs, num_stages=2, device=COMPUTE_BOUND)
    assert not fx_plan.dynamic_dims and "fixed by torch.export" not in fx_plan.summary()  # fx fixes no dim


class Scaled(nn.Module):
    """Export bakes in what is not a weight: a flag read by Python, a plain tensor attribute."""

    def __init__(self, flip: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.flip = flip
        self.offset = torch.full((8,), offset)  # an attribute, not a buffer: a constant in the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:  # a shape branch: fx cannot trace it
            x = -x if self.flip else x
        return torch.tanh(self.l1(x)) + self.offset


def _exports_of(model: nn.Module, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[int, torch.Tensor]:
    """How many times torch.export ran to trace ``model``, and the traced graph's output on ``x``."""
    from replica.partition import export as exporting

    calls = []
    real = exporting._export
    monkeypatch.setattr(exporting, "_export", lambda *a, **k: calls.append(1) or real(*a, **k))
    traced = trace(model, (x,), tracer="export")
    monkeypatch.setattr(exporting, "_export", real)
    return len(calls), traced.module(x)


def test_the_same_model_again_is_not_exported_again_and_reads_its_own_weights(monkeypatch):
    from replica.partition import export as exporting

    monkeypatch.setattr(exporting, "_EXPORTS", exporting.Kept(8))
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    first = Scaled()
    assert _exports_of(first, x, monkeypatch)[0] == 1
    torch.manual_seed(1)  # another model built alike: other weights, the same export
    second = Scaled()
    runs, out = _exports_of(second, x, monkeypatch)
    assert runs == 0
    torch.testing.assert_close(out, second(x), rtol=0, atol=0)
    # what export bakes in, changed: exported again, and each graph computes its own model
    for changed in (Scaled(flip=True), Scaled(offset=1.0), Scaled().eval(), Scaled().double()):
        changed.l1.load_state_dict(second.l1.state_dict())
        xx = x.to(changed.l1.weight.dtype)
        runs, out = _exports_of(changed, xx, monkeypatch)
        assert runs == 1
        torch.testing.assert_close(out, changed(xx), rtol=0, atol=0)
    assert _exports_of(Scaled(), x, monkeypatch)[0] == 0  # the first one is still kept
    with monkeypatch.context() as patched:  # the class's code changed: exported again
        patched.setattr(Scaled, "forward", lambda self, x: torch.sigmoid(self.l1(x)) if x.shape[0] else x)
        patched_model = Scaled()
        runs, out = _exports_of(patched_model, x, monkeypatch)
        assert runs == 1
        torch.testing.assert_close(out, torch.sigmoid(patched_model.l1(x)), rtol=0, atol=0)
    assert _exports_of(Scaled(), torch.randn(4, 8, 2)[..., 0], monkeypatch)[0] == 1  # other strides
    assert _exports_of(Scaled(), torch.randn(2, 8), monkeypatch)[0] == 1  # another input shape
    assert len(exporting._EXPORTS) <= exporting._EXPORTS.size


SHIFT = 0.0  # read by Globals' helper: export bakes it in as it bakes in an attribute


def _shifted(x: torch.Tensor) -> torch.Tensor:
    return x + SHIFT


class Globals(nn.Module):
    """Reads a module-level flag in its forward and a module-level number through a helper."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:  # a shape branch: fx cannot trace it
            x = -x if FLIP else x
        return _shifted(self.l1(x))


FLIP = False


def test_a_changed_global_the_forward_reads_is_exported_again(monkeypatch):
    """The kept export's key holds the globals a forward reads, through the helpers it calls, and a
    closure's cells: changed, the model is exported again and computes as the plain one does
    (before, the graph of the old value came back: a silently wrong model)."""
    from replica.partition import export as exporting

    monkeypatch.setattr(exporting, "_EXPORTS", exporting.Kept(8))
    x = torch.randn(4, 8)
    model = Globals()
    assert _exports_of(model, x, monkeypatch)[0] == 1
    assert _exports_of(model, x, monkeypatch)[0] == 0  # nothing changed: kept
    for name, value in (("FLIP", True), ("SHIFT", 2.0)):  # the forward's own global, then its helper's
        monkeypatch.setattr(sys.modules[__name__], name, value)
        runs, out = _exports_of(model, x, monkeypatch)
        assert runs == 1, name
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert _exports_of(model, x, monkeypatch)[0] == 0

    monkeypatch.setattr(Scaled, "forward", _scaled_forward)
    scaled = Scaled()
    assert _exports_of(scaled, x, monkeypatch)[0] == 1
    for scale in (2.0, 3.0):  # the same helper function, its closure's cell rebound: keyed by value
        _set_scale(scale)
        runs, out = _exports_of(scaled, x, monkeypatch)
        assert runs == 1, scale
        torch.testing.assert_close(out, scaled(x), rtol=0, atol=0)
    _set_scale(1.0)


def _adjustable(scale: float):  # noqa: ANN202
    def scale_by(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    def set_scale(value: float) -> None:
        nonlocal scale
        scale = value

    return scale_by, set_scale


_scale, _set_scale = _adjustable(1.0)


def _scaled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _scale(torch.tanh(self.l1(x)) if x.shape[0] else x)


def test_the_globals_key_gives_up_past_its_walk_limit(monkeypatch):
    from replica.partition import export as exporting

    monkeypatch.setattr(exporting, "_GLOBALS_WALK_LIMIT", 1)
    assert exporting.structure_key(Globals(), (torch.randn(4, 8),)) is None  # forward and helper: 2 functions
    monkeypatch.setattr(exporting, "_GLOBALS_WALK_LIMIT", 2)
    assert exporting.structure_key(Globals(), (torch.randn(4, 8),)) is not None


def test_an_attribute_of_an_unknown_kind_is_exported_every_time(monkeypatch):
    from replica.partition import export as exporting

    monkeypatch.setattr(exporting, "_EXPORTS", exporting.Kept(8))
    model = Scaled()
    model.helper = object()  # what it does to the code cannot be told by its value
    assert [_exports_of(model, torch.randn(4, 8), monkeypatch)[0] for _ in range(2)] == [1, 1]
    assert len(exporting._EXPORTS) == 0


def test_a_model_built_alike_trains_from_the_kept_trace_to_the_plain_gradients(monkeypatch):
    """The second model of each pair is planned from the kept export (ShapeBranch: tied, export's path)
    or the kept shapes (tiny GPT: fx's path); every gradient is the plain model's."""
    from replica.partition import export as exporting
    from replica.partition import record as recording
    from tests import models

    monkeypatch.setattr(exporting, "_EXPORTS", exporting.Kept(8))
    monkeypatch.setattr(recording, "_RECORDS", recording.Kept(16))
    exports, records = [], []
    real_export, real_record = exporting._export, recording._run_recorder
    monkeypatch.setattr(exporting, "_export", lambda *a: exports.append(1) or real_export(*a))
    monkeypatch.setattr(recording, "_run_recorder", lambda *a: records.append(1) or real_record(*a))
    ids, target = batch()

    def gpt() -> tuple[nn.Module, tuple, torch.Tensor, object]:
        model, inputs, tgt, loss_fn = models.tiny_gpt(8)[:4]
        return model, inputs, tgt, loss_fn

    def branch() -> tuple[nn.Module, tuple, torch.Tensor, object]:
        return ShapeBranch(), (ids,), target, dict_loss

    for build in (branch, gpt):
        for seed in (0, 1):  # the second: other weights, the trace kept from the first
            torch.manual_seed(seed)
            model, inputs, tgt, loss_fn = build()
            plain = copy.deepcopy(model)
            pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                                       device=COMPUTE_BOUND)
            pm.train_step(inputs, tgt)
            loss_fn(plain(*inputs), tgt).backward()
            want = dict(plain.named_parameters())
            for name, p in pm.named_parameters():
                torch.testing.assert_close(p.grad, want[name].grad, msg=lambda m: f"{build.__name__} {name}: {m}")
    assert len(exports) == 1  # ShapeBranch exported once
    assert len(records) == 2  # once per pair
