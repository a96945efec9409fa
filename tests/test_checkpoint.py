"""Checkpoints in one process: round trip, resuming on another stage count, corrupt ones skipped with a
warning, atomic writes, the plain model loading them, and everything read with weights_only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import replica
from examples.cifar10.model import CifarCNN
from replica.checkpoint import store as ckpt
from replica.checkpoint.store import CheckpointError
from replica.checkpoint.tensors import load_into_plain_model
from replica.train.rng import rng_state, set_rng_state
from tests.train_cases import (
    ACROSS_LAYOUTS,
    DATA,
    EPOCHS,
    Stop,
    assert_same_weights,
    make_trainer,
    run,
    small_cnn,
    weights,
)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    """The reference: the whole run in one go, one stage."""
    torch.manual_seed(0)
    trainer = make_trainer(batch_size=32, model_seed=0)
    trainer.train_dataset(*DATA, epochs=EPOCHS)
    return weights(trainer.model)


def test_round_trip_resumes_exactly(tmp_path: Path, uninterrupted) -> None:
    run(tmp_path, stop_at=5)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]
    second = run(tmp_path)  # a fresh model from another seed: everything comes from the checkpoint
    assert second.resumed_from.name == "step-00000004" and second.step == 9 and second.epoch == EPOCHS
    assert_same_weights(weights(second.model), uninterrupted)


def test_the_checkpoint_is_complete_checksummed_and_keyed_by_name(tmp_path: Path) -> None:
    trainer = run(tmp_path, stop_at=2)
    path = tmp_path / "step-00000002"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "rank-00000.pt", "trainer.pt"}
    assert manifest["step"] == 2 and manifest["world_size"] == 1 and manifest["format"] == 2
    assert manifest["trainer"] | {"layout": None} == {
        "step": 2, "epoch": 0, "batch": 2, "call": 0, "call_start_epoch": 0, "batch_size": 32, "shuffle": True,
        "seed": 0, "num_samples": 100, "layout": None}
    plan = trainer.pipeline.plan  # the manifest records the plan that wrote it
    assert manifest["trainer"]["layout"] == {
        "num_stages": plan.num_stages, "num_microbatches": plan.num_microbatches, "schedule": plan.schedule,
        "data_parallel_size": 1, "tensor_parallel_size": 1, "sharding": plan.layout.sharding,
        "shard_group_size": plan.layout.shard_group_size, "describe": plan.layout.describe(), "world_size": 1}
    assert ckpt.verify(path) is None
    # torch.distributed.checkpoint alone loads the weights into the plain model's state_dict, original names
    plain = small_cnn()
    state = plain.state_dict()
    with ckpt.single_process_quietly():
        dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    assert_same_weights(weights(plain), weights(trainer.model))
    # the optimizer state is keyed by parameter name, its hyper-parameters too
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = {n for n, _ in trainer.model.named_parameters()}
    assert {k for k in stored if k.startswith("optimizer.state.")} == {
        f"optimizer.state.{n}.{k}" for n in names for k in ("step", "exp_avg", "exp_avg_sq")}
    extras = torch.load(path / "trainer.pt", weights_only=True)
    assert extras[0]["param_groups"][0]["lr"] == 1e-2 and "features.0.weight" in extras[0]["param_groups"][0]["params"]


def test_an_asynchronous_save_is_published_by_the_next_save_and_resumes_exactly(tmp_path: Path,
                                                                                uninterrupted) -> None:
    run(tmp_path, stop_at=7, checkpoint_async=True)  # dies with step 6 in flight: published by then is step 4
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]
    resumed = run(tmp_path, checkpoint_async=True)
    assert resumed.resumed_from.name == "step-00000004"
    assert_same_weights(weights(resumed.model), uninterrupted)
    assert ckpt.verify(tmp_path / "step-00000009") is None, "train_dataset returns with its last save published"


def test_load_into_plain_model_takes_a_directory_or_a_step(tmp_path: Path) -> None:
    trainer = run(tmp_path, num_stages=3, num_microbatches=4)
    newest = load_into_plain_model(tmp_path, small_cnn())
    assert_same_weights(weights(newest), weights(trainer.model))
    older = load_into_plain_model(tmp_path / "step-00000006", small_cnn())
    assert not torch.equal(older.classifier[-1].weight, newest.classifier[-1].weight)
    with pytest.raises(CheckpointError, match=r"another model: .* 2 missing \(first: weight, bias\)"):
        load_into_plain_model(tmp_path, torch.nn.Linear(2, 2))
    wider = CifarCNN(channels=(8, 16), hidden=64, image_size=16)
    with pytest.raises(CheckpointError,
                       match=r"another model: .* 3 mis-shaped \(first: classifier.1.weight \(32, 256\) where"):
        load_into_plain_model(tmp_path, wider)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .* \(0 step-XXXXXXXX"):
        load_into_plain_model(tmp_path / "nothing-here", small_cnn())


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (1, 3)])
def test_resuming_on_another_number_of_stages_continues_identically(tmp_path: Path, uninterrupted,
                                                                   before: int, after: int) -> None:
    run(tmp_path, stop_at=5, num_stages=before)
    resumed = run(tmp_path, num_stages=after)
    assert resumed.pipeline.plan.num_stages == after and resumed.resumed_from.name == "step-00000004"
    assert_same_weights(weights(resumed.model), uninterrupted, **ACROSS_LAYOUTS)
    same_layout = run(tmp_path / "same", num_stages=after, model_seed=0)
    assert_same_weights(weights(resumed.model), weights(same_layout.model), **ACROSS_LAYOUTS)


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda p: _flip_a_byte(p / "__0_0.distcp"), "fails its sha256 checksum"),
    (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    (lambda p: (p / "manifest.json").unlink(), "has no manifest.json"),
    (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
    (lambda p: (p / "rank-00000.pt").write_bytes(b"short"), "has 5 bytes, the manifest says"),
])
def test_a_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path: Path, uninterrupted, damage, problem) -> None:
    run(tmp_path, stop_at=7)
    damage(tmp_path / "step-00000006")
    (tmp_path / ".tmp-step-00000008").mkdir()  # a save that died half-way is never a candidate
    with pytest.warns(RuntimeWarning, match=f"step-00000006 is corrupt or incomplete: .*{problem}"):
        resumed = run(tmp_path)
    assert resumed.resumed_from.name == "step-00000004"
    assert (tmp_path / "corrupt-step-00000006").is_dir(), "the bad one is kept aside, not deleted"
    assert_same_weights(weights(resumed.model), uninterrupted)
    assert not (tmp_path / ".tmp-step-00000008").exists()


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    run(tmp_path, checkpoint_every_steps=1, keep_checkpoints=2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000008", "step-00000009"]


def test_without_a_step_interval_every_epoch_is_saved(tmp_path: Path) -> None:
    run(tmp_path, checkpoint_every_steps=None, keep_checkpoints=10)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000003", "step-00000006", "step-00000009"]
    assert ckpt.read_manifest(tmp_path / "step-00000003")["trainer"]["epoch"] == 1  # the next epoch, batch 0


def test_a_failed_write_leaves_no_checkpoint_and_raises(tmp_path: Path, monkeypatch) -> None:
    run(tmp_path, stop_at=3)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(obj, torch.Tensor):  # DCP writes each tensor with torch.save
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"rank 0 could not write its shards to .*\.tmp-step-00000004"):
        run(tmp_path)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002"]
    assert ckpt.verify(tmp_path / "step-00000002") is None


_KILLED_MID_SAVE = """
import os, sys, torch
from tests.train_cases import run
real_save = torch.save
def killed(obj, f, *args, **kwargs):
    if isinstance(obj, torch.Tensor) and os.path.isdir(os.path.join(sys.argv[1], ".tmp-step-00000004")):
        os._exit(9)  # the process dies with DCP's files half written
    return real_save(obj, f, *args, **kwargs)
torch.save = killed
run(sys.argv[1], model_seed=0)  # the uninterrupted run's model
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_to_resume(tmp_path: Path, uninterrupted) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    died = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path)], env=env, capture_output=True)
    assert died.returncode == 9, died.stderr.decode()[-2000:]
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002"]
    assert (tmp_path / ".tmp-step-00000004").is_dir(), "the half-written step is never published"
    resumed = run(tmp_path)
    assert resumed.resumed_from.name == "step-00000002"
    assert_same_weights(weights(resumed.model), uninterrupted)


def test_a_read_only_directory_is_an_error_naming_it_and_the_last_checkpoint_stays(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    run(tmp_path, stop_at=3)
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args, **kwargs):  # as chmod 555 does for a user who is not root
        if self.name.startswith(".tmp-step"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint step 4 into {tmp_path}: .*Permission denied"):
        run(tmp_path)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002"]
    assert ckpt.verify(tmp_path / "step-00000002") is None


def test_dropout_resumes_identically_because_rng_states_are_restored(tmp_path: Path) -> None:
    reference = make_trainer(batch_size=32, dropout=True)
    reference.train_dataset(*DATA, epochs=2)
    run(tmp_path, stop_at=3, dropout=True, epochs=2)
    torch.manual_seed(1234)  # a different global RNG state: the checkpoint's must win
    resumed = run(tmp_path, dropout=True, epochs=2)
    assert_same_weights(weights(resumed.model), weights(reference.model))


def test_replayed_calls_skip_what_the_checkpoint_shows_finished(tmp_path: Path) -> None:
    reference = make_trainer(batch_size=32)
    reference.train_dataset(*DATA, epochs=1)
    reference.train_dataset(*DATA, epochs=2)

    def script(stop_at: int | None) -> replica.train.Trainer:
        trainer = make_trainer(batch_size=32, checkpoint_dir=str(tmp_path), checkpoint_every_steps=2,
                               model_seed=0 if stop_at else 5)
        first = trainer.train_dataset(*DATA, epochs=1)
        try:
            trainer.train_dataset(*DATA, epochs=2,
                                  on_step_end=lambda t: t.step == stop_at and (_ for _ in ()).throw(Stop))
        except Stop:
            pass
        trainer.first_call_history = first
        return trainer

    script(stop_at=7)
    again = script(stop_at=None)
    assert again.first_call_history == [], "the first call had finished: the restart skips it"
    assert again.resumed_from.name == "step-00000006" and again.step == 9
    assert_same_weights(weights(again.model), weights(reference.model))


def test_rng_states_round_trip_through_weights_only(tmp_path: Path) -> None:
    import random

    import numpy as np

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_resuming_with_other_data_settings_is_refused(tmp_path: Path) -> None:
    run(tmp_path, stop_at=3)
    with pytest.raises(replica.ConfigError, match="batch_size=32, but this call has batch_size=16"):
        trainer = make_trainer(checkpoint_dir=str(tmp_path), batch_size=16)
        trainer.train_dataset(*DATA, epochs=1)


def _forge_checksums(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    for name, info in manifest["files"].items():  # so that only the reader can object
        info.update(sha256=ckpt._sha256(path / name), bytes=(path / name).stat().st_size)
    (path / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path(__file__).with_name("PWNED-by-a-checkpoint"),))


def test_files_are_read_with_weights_only_and_a_forged_index_is_refused(tmp_path: Path) -> None:
    import pickle

    run(tmp_path, stop_at=3)
    path = tmp_path / "step-00000002"
    torch.save({"torch": Path("not a tensor")}, path / "rank-00000.pt")  # an arbitrary object
    _forge_checksums(path)
    with pytest.raises(CheckpointError, match="cannot be read .*Weights only load failed"):
        run(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload()))  # DCP would run it: pickle.load
    _forge_checksums(path)
    for read in (lambda: run(tmp_path), lambda: load_into_plain_model(path, small_cnn()),
                 lambda: replica.export_safetensors(path, tmp_path / "hf")):
        with pytest.raises(CheckpointError, match=r"\.metadata cannot be read .*pathlib.Path.touch is not something"):
            read()
    assert not Path(__file__).with_name("PWNED-by-a-checkpoint").exists()


def test_a_format_1_checkpoint_still_resumes_read_only(tmp_path: Path, uninterrupted) -> None:
    """Written as before DCP (whole tensors per pipeline rank, torch.save): resumed, exported and loaded
    into the plain model; the run's next checkpoints are format 2."""
    from replica.train.optim import state_by_name

    trainer = run(None, stop_at=4, model_seed=0)
    step = tmp_path / "step-00000004"
    step.mkdir()
    files = {name: ckpt._write(step / name, obj) for name, obj in (
        ("model-00000-of-00001.pt", trainer.model.state_dict()),
        ("optim-00000-of-00001.pt", state_by_name(trainer.optimizer, trainer._names)),
        ("rng-00000-of-00001.pt", rng_state()))}
    meta = {"step": 4, "epoch": 1, "batch": 1, "call": 0, "call_start_epoch": 0, "batch_size": 32, "shuffle": True,
            "seed": 0, "num_samples": 100}
    (step / "manifest.json").write_text(json.dumps({"format": 1, "step": 4, "num_shards": 1, "trainer": meta,
                                                    "files": files, "tied_parameters": {}}))
    assert_same_weights(weights(load_into_plain_model(step, small_cnn())), weights(trainer.model))
    resumed = run(tmp_path)
    assert resumed.resumed_from.name == "step-00000004"
    assert_same_weights(weights(resumed.model), uninterrupted)
    assert ckpt.read_manifest(tmp_path / "step-00000009")["format"] == 2


def test_resume_from_a_copied_directory(tmp_path: Path, uninterrupted) -> None:
    run(tmp_path / "a", stop_at=5)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert_same_weights(weights(run(tmp_path / "b").model), uninterrupted)


def test_the_one_process_readers_hold_one_tensor_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """load_into_plain_model fills the model's own tensors, export writes each tensor before reading the
    next: neither holds more than a tensor or two (benchmarks/checkpoint_readers.py measures a GPT)."""
    import weakref

    from benchmarks.sharded_dp import allocation_peak
    from replica.checkpoint.tensors import StoredWeights

    def layers() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])

    torch.manual_seed(0)
    model = layers()
    ckpt.save(tmp_path, 1, {k: v.detach() for k, v in model.state_dict().items()}, rng_state(), {}, keep=1)
    largest = 128 * 128 * 4
    plain = layers()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        load_into_plain_model(tmp_path, plain)
    assert allocation_peak(prof) <= 2 * largest, allocation_peak(prof)  # the model: 6.0x
    assert_same_weights(weights(plain), weights(model), rtol=0, atol=0)

    alive, read_so_far = [], []
    real_read = StoredWeights.read

    def read(self: StoredWeights, name: str) -> torch.Tensor:
        alive.append(sum(r() is not None for r in read_so_far))
        tensor = real_read(self, name)
        read_so_far.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(StoredWeights, "read", read)
    replica.export_safetensors(tmp_path, tmp_path / "hf")
    assert alive == [0] * 12, alive
