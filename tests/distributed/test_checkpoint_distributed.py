"""Checkpoints through torch.distributed.checkpoint on 4 gloo ranks, moved between layouts: written in
2 pipeline x 2 zero3 replicas, resumed in 2 tensor-parallel x 2 replicas (saving in the background),
then in 2 zero3 replicas x 2 tensor-parallel ranks, then in one process, then into the plain model and
its AdamW; the step after each resume equals the uninterrupted run's. Every
rank writes its own shards, torch.distributed.checkpoint alone reads them into the plain model, and
another model's checkpoint is refused by name on every rank.

One ``run_local`` job does every distributed layout in sequence: first layouts the chain does not visit (bf16
among them) and a full disk under one rank, then the chain; the one-process resumes run here.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import replica
from replica.checkpoint import store as ckpt
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.train_cases import ACROSS_LAYOUTS, assert_same_weights, weights

pytestmark = pytest.mark.distributed

PP2_ZERO3 = dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel="zero3")
TP2_DP2 = dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel=False)
ZERO3_TP2 = dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel="zero3")
LR, WEIGHT_DECAY = 1e-2, 0.1


def _case(num_layers: int = 2) -> models.ModelCase:
    """The same tiny GPT (tied head) and batch of 8 in every process: one step per epoch."""
    torch.manual_seed(0)
    return models.tiny_gpt(8, num_layers=num_layers)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _trainer(directory: Path, layout: dict, num_layers: int = 2) -> replica.train.Trainer:
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    case = _case(num_layers)
    config = default_config(batch_size=8, num_microbatches=2, schedule="1f1b", shuffle=False,
                            checkpoint_dir=str(directory), progress=False, timeout_s=STEP_TIMEOUT_S,
                            device=COMPUTE_BOUND, **layout)
    return get_trainer(config, case.model, case.loss_fn, _optimizer)


def _copy_newest(source: Path, target: Path) -> None:
    """Rank 0 starts ``target`` with ``source``'s newest checkpoint; every rank waits for it."""
    if dist.get_rank() == 0:
        newest = ckpt.checkpoints(source)[-1]
        shutil.copytree(newest, target / newest.name)
    dist.barrier()


def layouts_job(rank: int, world: int, root: str) -> bytes:
    torch.set_num_threads(1)
    root_path = Path(root)
    case = _case()
    report: dict = {}
    # 2 steps in 2 pipeline ranks x 2 zero3 replicas: every rank writes its own shards
    first = _trainer(root_path / "a", PP2_ZERO3)
    first.train_dataset(case.example_inputs[0], case.target, epochs=2)
    step = root_path / "a" / "step-00000002"
    report["a"] = (first.pipeline.plan.layout.describe(), first.step, (step / f"__{rank}_0.distcp").stat().st_size)
    # resumed in 2 tensor-parallel ranks x 2 replicas: one step more, saved in the background
    _copy_newest(root_path / "a", root_path / "b")
    second = _trainer(root_path / "b", {**TP2_DP2, "checkpoint_async": True})
    second.train_dataset(case.example_inputs[0], case.target, epochs=3)
    report["b"] = (second.pipeline.plan.layout.describe(), second.step, second.resumed_from.name,
                   second.history[-1]["loss"])
    # resumed in 2 zero3 replicas x 2 tensor-parallel ranks (FSDP2 over the fused q/k/v pieces): one step more,
    # saved in the background
    _copy_newest(root_path / "b", root_path / "b2")
    third = _trainer(root_path / "b2", {**ZERO3_TP2, "checkpoint_async": True})
    third.train_dataset(case.example_inputs[0], case.target, epochs=4)
    report["b2"] = (third.pipeline.plan.layout.describe(), third.step, third.resumed_from.name,
                    third.history[-1]["loss"])
    # another model (3 blocks, not 2) on that checkpoint: refused on every rank, by name
    try:
        _trainer(root_path / "b", PP2_ZERO3, num_layers=3).train_dataset(case.example_inputs[0], case.target, epochs=4)
        report["other"] = None
    except replica.CheckpointError as exc:
        report["other"] = str(exc)
    return _portable(report)


def other_layouts_job(rank: int, world: int, root: str, legs: list) -> bytes:
    """Per leg: 2 steps in one layout; resumed in another, saved again at once (the same step 2, as the
    new layout holds it), then one step more. Reports each layout and the loss of step 3."""
    torch.set_num_threads(1)
    case = _case()
    x, y = case.example_inputs[0], case.target
    report = []
    for i, (before, after) in enumerate(legs):
        a, b = Path(root) / f"a{i}", Path(root) / f"b{i}"
        first = _trainer(a, before)
        first.train_dataset(x, y, epochs=2)
        _copy_newest(a, b)
        second = _trainer(b, after)
        assert second.train_dataset(x, y, epochs=2) == []  # resumed: the 2 epochs are done
        second.save_checkpoint()  # step 2 again, written by the new layout
        last = second.train_dataset(x, y, epochs=1)  # step 3
        report.append((first.pipeline.plan.layout.describe(), first.pipeline.plan.precision,
                       second.pipeline.plan.layout.describe(), second.resumed_from.name, second.step,
                       last[-1]["loss"]))
    # the disk fills up under rank 1 while it writes its shards of step 3 again: every rank says so
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if rank == 1 and isinstance(obj, torch.Tensor):  # DCP writes each tensor with torch.save
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    torch.save = full_disk
    try:
        second.save_checkpoint()
        failed = None
    except replica.CheckpointError as exc:
        failed = str(exc)
    finally:
        torch.save = real_save
    return _portable({"legs": report, "full_disk": failed})


def checkpoint_job(rank: int, world: int, root: str, legs: list) -> bytes:
    """Both jobs in one start of 4 ranks (starting them costs more here than their steps)."""
    other = pickle.loads(other_layouts_job(rank, world, str(Path(root) / "legs"), legs))
    chain = pickle.loads(layouts_job(rank, world, str(Path(root) / "chain")))
    return _portable({"chain": chain, "legs": other})


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("checkpoints")
    return root, _run(checkpoint_job, 4, str(root), OTHER_LEGS)


def _reference(steps: int, autocast: bool = False) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """The uninterrupted run, in plain torch (under bf16 autocast with ``autocast``): the weights after
    each step (index 0: the initial ones) and each step's loss."""
    case = _case()
    optimizer = _optimizer(case.model.parameters())
    out, losses = [weights(case.model)], []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = case.loss_fn(case.model(*case.example_inputs), case.target)
        loss.backward()
        optimizer.step()
        out.append(weights(case.model))
        losses.append(float(loss))
    return out, losses


def _stored(step: Path) -> dict[str, torch.Tensor]:
    plain = _case().model
    replica.load_into_plain_model(step, plain)
    return weights(plain)


def test_a_checkpoint_resumes_in_any_layout_and_continues_the_uninterrupted_run(four_ranks) -> None:
    tmp_path, reports = four_ranks[0] / "chain", [r["chain"] for r in four_ranks[1]]
    reference, losses = _reference(6)
    a, b, b2 = reports[0]["a"], reports[0]["b"], reports[0]["b2"]
    assert "2 pipeline x 2 data (zero3" in a[0] and a[1] == 2, a
    assert "2 data" in b[0] and "x 2 tensor" in b[0] and "zero" not in b[0] and b[1] == 3, b
    assert b[2] == "step-00000002"
    assert "2 data (zero3" in b2[0] and "x 2 tensor" in b2[0] and b2[1] == 4 and b2[2] == "step-00000003", b2
    assert_same_weights(_stored(tmp_path / "a" / "step-00000002"), reference[2], **ACROSS_LAYOUTS)
    assert_same_weights(_stored(tmp_path / "b" / "step-00000003"), reference[3], **ACROSS_LAYOUTS)
    assert_same_weights(_stored(tmp_path / "b2" / "step-00000004"), reference[4], **ACROSS_LAYOUTS)
    # the step after each resume: the uninterrupted run's loss too (one step per epoch)
    assert b[3] == pytest.approx(losses[2], rel=1e-5) and b2[3] == pytest.approx(losses[3], rel=1e-5), (b, b2)

    # every rank wrote its own shards, none most of them
    written = [r["a"][2] for r in reports]
    assert min(written) > 0 and max(written) <= 0.4 * sum(written), written

    # checksummed per rank, and exported tensor by tensor with the tied head once, as Hugging Face stores it
    step = tmp_path / "a" / "step-00000002"
    assert ckpt.verify(step) is None
    assert {f"__{r}_0.distcp" for r in range(4)} | {f"rank-{r:05d}.pt" for r in range(4)} <= set(
        ckpt.read_manifest(step)["files"])
    exported = load_file(str(replica.export_safetensors(step, tmp_path / "hf")))
    assert "lm_head.weight" not in exported and reference[2].keys() <= exported.keys()  # and the buffers
    assert_same_weights({k: exported[k] for k in reference[2]}, reference[2], **ACROSS_LAYOUTS)

    # torch.distributed.checkpoint alone: the plain model's state_dict, original names (the tied head too)
    plain = _case().model
    state = plain.state_dict()
    with ckpt.single_process_quietly():
        dcp.load(state, checkpoint_id=tmp_path / "a" / "step-00000002", no_dist=True)
    plain.load_state_dict(state)
    assert_same_weights(weights(plain), reference[2], **ACROSS_LAYOUTS)

    # another model's checkpoint: every rank names the first missing and mis-shaped names
    for r in reports:
        assert r["other"] is not None and "another model" in r["other"], r["other"]
        assert "missing (first: transformer.h.2." in r["other"], r["other"]
        assert "aliases=" not in r["other"] and "all_names=" not in r["other"]

    # one process (2 stages here): resumed from the FSDP x tensor-parallel run's step 4, one step more
    shutil.copytree(tmp_path / "b2" / "step-00000004", tmp_path / "c" / "step-00000004")
    here = _trainer(tmp_path / "c", dict(num_stages=2))
    here.train_dataset(_case().example_inputs[0], _case().target, epochs=5)
    assert here.resumed_from.name == "step-00000004" and here.step == 5
    assert here.history[-1]["loss"] == pytest.approx(losses[4], rel=1e-5)
    assert_same_weights(weights(here.model), reference[5], **ACROSS_LAYOUTS)

    # the plain model and a plain AdamW: weights and moments by name; plain torch takes step 6
    case = _case()
    torch.manual_seed(1)
    model = models.tiny_gpt(8).model  # other weights: all must come from the checkpoint
    optimizer = _optimizer(model.parameters())
    replica.load_into_plain_model(tmp_path / "c", model, optimizer=optimizer)
    assert optimizer.param_groups[0]["weight_decay"] == WEIGHT_DECAY
    optimizer.zero_grad()
    loss = case.loss_fn(model(*case.example_inputs), case.target)
    loss.backward()
    optimizer.step()
    assert float(loss) == pytest.approx(losses[5], rel=1e-5)
    assert_same_weights(weights(model), reference[6], **ACROSS_LAYOUTS)


def _plain_state(step: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoint ``step`` in the plain model and its AdamW: weights, and every moment and step count by name."""
    torch.manual_seed(1)
    model = models.tiny_gpt(8).model
    optimizer = _optimizer(model.parameters())
    replica.load_into_plain_model(step, model, optimizer=optimizer)
    state = {f"{n}.{k}": v.clone() for n, p in model.named_parameters() for k, v in optimizer.state[p].items()}
    return weights(model), state


# layouts the chain above does not visit, and bf16 (weights, gradients' reduction and AdamW stay fp32)
OTHER_LEGS = [
    (dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel=False),
     dict(num_stages=1, data_parallel_size=4, tensor_parallel_size=1, sharded_data_parallel="zero3")),
    (dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel="zero2"),
     dict(num_stages=1, data_parallel_size=1, tensor_parallel_size=4, sharded_data_parallel=False)),
    (dict(num_stages=1, data_parallel_size=4, tensor_parallel_size=1, sharded_data_parallel="zero2",
          mixed_precision="bf16"),
     dict(num_stages=2, data_parallel_size=1, tensor_parallel_size=2, sharded_data_parallel=False,
          mixed_precision="bf16")),
]


def _one_plain_step(step: Path, autocast: bool) -> tuple[dict[str, torch.Tensor], float]:
    """Checkpoint ``step`` in the plain model and AdamW, one step more in plain torch (under bf16 autocast
    with ``autocast``): the weights after it and its loss."""
    case = _case()
    torch.manual_seed(1)
    model = models.tiny_gpt(8).model
    optimizer = _optimizer(model.parameters())
    replica.load_into_plain_model(step, model, optimizer=optimizer)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = case.loss_fn(model(*case.example_inputs), case.target)
    loss.backward()
    optimizer.step()
    return weights(model), float(loss)


def _bf16_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """One AdamW step under bf16 in two layouts: the same but where a gradient is round-off (a key bias's
    is zero in exact arithmetic), which AdamW scales to +-lr either way. Measured at lr 1e-2: 59 of 28032
    elements more than 1e-3 apart, at most 0.0094 (a c_attn bias)."""
    far = sum(int(((got[k] - want[k]).abs() > 1e-3 + 2e-2 * want[k].abs()).sum()) for k in want)
    total = sum(t.numel() for t in want.values())
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert far <= 0.005 * total and worst <= 2 * LR, (far, total, worst)


def test_other_layouts_resave_the_same_state_and_continue_the_run(four_ranks) -> None:
    tmp_path, ranks = four_ranks[0] / "legs", [r["legs"] for r in four_ranks[1]]
    reports, full_disk = [r["legs"] for r in ranks], [r["full_disk"] for r in ranks]
    assert all(r == reports[0] for r in reports), reports  # every rank reports the same loss
    # a full disk on one rank: a CheckpointError on every rank naming the directory; step 3 stays as it was
    last = tmp_path / f"b{len(OTHER_LEGS) - 1}"
    for said in full_disk:
        assert said is not None and f"{last / '.tmp-step-00000003'}" in said and "No space left" in said, said
    assert [p.name for p in ckpt.checkpoints(last)] == ["step-00000002", "step-00000003"]
    assert ckpt.verify(last / "step-00000003") is None
    reference, losses = _reference(3)
    for i, (before, precision, after, resumed_from, step, loss) in enumerate(reports[0]):
        assert resumed_from == "step-00000002" and step == 3, reports[0][i]
        first, second = tmp_path / f"a{i}" / "step-00000002", tmp_path / f"b{i}" / "step-00000002"
        # what the second layout wrote of the state it loaded is, bit for bit, what the first one wrote
        saved, moments = _plain_state(first)
        again, moments_again = _plain_state(second)
        assert_same_weights(again, saved, rtol=0, atol=0)
        assert_same_weights(moments_again, moments, rtol=0, atol=0)
        index = dcp.FileSystemReader(second).read_metadata().state_dict_metadata
        assert {m.properties.dtype for m in index.values() if hasattr(m, "properties")} == {torch.float32}
        # the step after the resume: plain torch's from the checkpoint
        bf16 = precision == "bf16"
        plain, plain_loss = _one_plain_step(first, autocast=bf16)
        after_resume = _stored(tmp_path / f"b{i}" / "step-00000003")
        assert loss == pytest.approx(plain_loss, rel=1e-3 if bf16 else 1e-5), (reports[0][i], plain_loss)
        if bf16:
            _bf16_close(after_resume, plain)
        else:  # and the uninterrupted run's
            assert_same_weights(after_resume, plain, **ACROSS_LAYOUTS)
            assert_same_weights(after_resume, reference[3], **ACROSS_LAYOUTS)
            assert loss == pytest.approx(losses[2], rel=1e-5), (reports[0][i], losses)
    describe = [(r[0], r[2]) for r in reports[0]]
    assert "2 pipeline x 2 data" in describe[0][0] and "zero" not in describe[0][0], describe
    assert "4 data (zero3" in describe[0][1], describe
    assert "2 pipeline x 2 data (zero2" in describe[1][0] and "4 tensor" in describe[1][1], describe
    assert "4 data (zero2" in describe[2][0] and "2 pipeline" in describe[2][1] and "2 tensor" in describe[2][1]
