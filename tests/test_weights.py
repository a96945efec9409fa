"""Reading a rank's weights by name: Hugging Face directories (single file and sharded, with or without the
base prefix, tied lm_head), plain safetensors files, Replica checkpoints, and every error listed at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import replica
import replica.weights
from replica.errors import ConfigError, ReplicaError
from replica.weights import WeightsError, read_weights, wanted_from

transformers = pytest.importorskip("transformers")

TIED = {"transformer.wte.weight": ("lm_head.weight",)}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each model and the directories save_pretrained wrote: one file, and sharded by ~20 KB."""
    out = {}
    for name, build in (("gpt2", gpt2), ("llama", llama)):
        model = build()
        for layout, kwargs in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
            directory = tmp_path_factory.mktemp(f"{name}-{layout}")
            model.save_pretrained(directory, **kwargs)
            out[f"{name}-{layout}"] = (model, directory)
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("case", ["gpt2-single", "gpt2-sharded", "llama-single", "llama-sharded"])
def test_every_weight_of_a_save_pretrained_directory(saved, case: str) -> None:
    model, directory = saved[case]
    state = model.state_dict()
    if case.startswith("llama-sharded"):
        assert (directory / "model.safetensors.index.json").is_file()
    got = read_weights(directory, wanted_from(state), aliases=TIED, all_names=state, strict_unexpected=True)
    assert_equal(got, state)


@pytest.mark.parametrize("case", ["gpt2-sharded", "llama-sharded"])
def test_a_rank_opens_only_the_shards_that_hold_its_names(saved, monkeypatch, case: str) -> None:
    model, directory = saved[case]
    state = model.state_dict()
    half = {n: t for i, (n, t) in enumerate(state.items()) if i >= len(state) // 2}  # the last stages' rank
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {weight_map[n if n in weight_map else "transformer.wte.weight"] for n in half}  # the tied lm_head
    assert 1 < len(shards) < len(set(weight_map.values()))
    opened = []
    real = replica.weights.safe_open

    def counting(file, *args, **kwargs):
        opened.append(Path(file).name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(replica.weights, "safe_open", counting)
    got = read_weights(directory, wanted_from(half), aliases=TIED)
    assert_equal(got, half)
    assert sorted(opened) == sorted(shards)


def test_a_plain_safetensors_file_is_cast_to_the_wanted_dtype(tmp_path: Path, monkeypatch) -> None:
    state = llama().state_dict()
    save_file({n: t.contiguous() for n, t in state.items()}, tmp_path / "weights.safetensors")
    wanted = {n: (tuple(t.shape), torch.bfloat16) for n, t in state.items()}
    got = read_weights(tmp_path / "weights.safetensors", wanted)
    assert_equal(got, {n: t.to(torch.bfloat16) for n, t in state.items()})
    monkeypatch.chdir(tmp_path.parent)  # a relative path to a directory with one .safetensors file in it
    on_meta = read_weights(tmp_path.name, wanted, device="meta")
    assert on_meta.keys() == state.keys() and all(t.is_meta and t.dtype == torch.bfloat16 for t in on_meta.values())


def test_a_base_model_checkpoint_reads_into_the_head_model_and_back(tmp_path: Path) -> None:
    model = gpt2()
    model.transformer.save_pretrained(tmp_path / "base")  # keys h.0..., wte.weight: no prefix, no lm_head
    state = model.state_dict()
    got = read_weights(tmp_path / "base", wanted_from(state), aliases=TIED)
    assert_equal(got, state)
    model.save_pretrained(tmp_path / "head")  # keys transformer.h.0...: the base model's names gain the prefix
    base = model.transformer.state_dict()
    assert_equal(read_weights(tmp_path / "head", wanted_from(base)), base)


def test_the_tied_lm_head_comes_from_the_embedding(saved) -> None:
    model, directory = saved["gpt2-single"]
    state = model.state_dict()
    head = read_weights(directory, {"lm_head.weight": ((128, 64), torch.float32)}, aliases=TIED)
    assert torch.equal(head["lm_head.weight"], state["transformer.wte.weight"])
    both = read_weights(directory, wanted_from({n: state[n] for n in ("transformer.wte.weight", "lm_head.weight")}),
                        aliases=TIED)
    assert both["lm_head.weight"] is both["transformer.wte.weight"]  # read once, shared like the model's
    with pytest.raises(WeightsError, match=r"1 missing:\n    lm_head.weight; closest stored"):
        read_weights(directory, {"lm_head.weight": ((128, 64), torch.float32)})


def test_names_shapes_and_dtypes_that_do_not_fit_are_listed_together(saved, monkeypatch) -> None:
    model, directory = saved["gpt2-single"]
    wanted = wanted_from(model.state_dict())
    wanted["transformer.h.0.mlp.c_fc.weight"] = ((64, 512), torch.float32)
    wanted["transformer.h.0.ln_1.bias"] = ((64,), torch.int64)
    wanted["transformer.h.2.ln_1.weight"] = ((64,), torch.float32)
    monkeypatch.setattr(replica.weights._Safetensors, "read", lambda *_: pytest.fail("read before checking"))
    with pytest.raises(WeightsError) as error:
        read_weights(directory, wanted, aliases=TIED)
    message = str(error.value)
    assert "names matched as stored" in message and "30 wanted" in message
    assert "1 missing:\n    transformer.h.2.ln_1.weight; closest stored: ['transformer.h.1.ln_1.weight'" in message
    assert "2 mis-shaped or mis-typed:" in message
    assert "transformer.h.0.mlp.c_fc.weight: stored transformer.h.0.mlp.c_fc.weight has shape (64, 256), " \
           "the model's is (64, 512)" in message
    assert "transformer.h.0.ln_1.bias: stored transformer.h.0.ln_1.bias is torch.float32, the model's is " \
           "torch.int64" in message
    assert isinstance(error.value, ReplicaError)


def test_a_checkpoint_of_another_model_is_unexpected_only_when_strict(saved) -> None:
    model, directory = saved["gpt2-single"]
    state = model.state_dict()
    one_layer = {n: t for n, t in state.items() if ".h.1." not in n}  # the model a 1-layer config builds
    rank = dict(list(one_layer.items())[:5])
    assert read_weights(directory, wanted_from(rank), all_names=one_layer).keys() == rank.keys()
    with pytest.raises(WeightsError, match=r"12 unexpected \(stored, but the model has no such name\):\n"
                                           r"    transformer.h.1.attn.c_attn.bias"):
        read_weights(directory, wanted_from(rank), all_names=one_layer, strict_unexpected=True)
    _, other = saved["llama-single"]
    # a Llama file: only its untied lm_head fits (and, through the tie, the embedding); the rest is foreign
    with pytest.raises(WeightsError, match=r"(?s)15 missing:\n    transformer.wpe.weight.*20 unexpected.*"
                                           r"    model.embed_tokens.weight\n"):
        read_weights(other, wanted_from(one_layer), aliases=TIED, strict_unexpected=True)


def test_paths_that_hold_no_readable_weights(saved, tmp_path: Path) -> None:
    wanted = {"wte.weight": ((128, 64), torch.float32)}
    with pytest.raises(WeightsError, match=r"nowhere does not exist; pass a .safetensors file"):
        read_weights(tmp_path / "nowhere", wanted)
    (tmp_path / "config.json").write_text("{}")
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"holds no weights read_weights recognises \(it has \['config.json', "
                                           r"'pytorch_model.bin'\]\).*safetensors.torch.save_file"):
        read_weights(tmp_path, wanted)
    with pytest.raises(WeightsError, match=r"pytorch_model.bin is not a readable safetensors file .*re-save it"):
        read_weights(tmp_path / "pytorch_model.bin", wanted)
    _, sharded = saved["llama-sharded"]
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = next(iter(weight_map.items()))
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in sharded.iterdir():
        if file.name != shard:
            (broken / file.name).symlink_to(file)
    with pytest.raises(WeightsError, match=rf"names 1 shard\(s\) missing from .*broken: \['{shard}'\]; the download"):
        read_weights(broken, wanted)
    (broken / shard).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match=rf"{shard} is not a readable safetensors file"):
        read_weights(broken, {name: ((1,), torch.float32)})
    with pytest.raises(ConfigError, match=r"wanted\['w'\] is \(\(2,\), 'float32'\); give \(shape, dtype\)"):
        read_weights(tmp_path, {"w": ((2,), "float32")})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- Replica checkpoints


def test_a_replica_checkpoint_reads_like_load_into_plain_model(tmp_path: Path) -> None:
    from tests.train_cases import run, small_cnn

    run(tmp_path, stop_at=5, num_stages=2)  # steps 2 and 4
    wanted = wanted_from(small_cnn().state_dict())
    for path in (tmp_path, tmp_path / "step-00000002"):
        plain = replica.load_into_plain_model(path, small_cnn()).state_dict()
        assert_equal(read_weights(path, wanted), plain)
    rank = dict(list(wanted.items())[-2:])
    newest = replica.load_into_plain_model(tmp_path, small_cnn()).state_dict()
    assert_equal(read_weights(tmp_path, rank), {n: newest[n] for n in rank})
    # a truncated newest step is passed over for the one before it, as the trainer would
    shard = tmp_path / "step-00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert_equal(read_weights(tmp_path, wanted), replica.load_into_plain_model(tmp_path / "step-00000002",
                                                                               small_cnn()).state_dict())
    with pytest.raises(WeightsError, match=r"no complete Replica checkpoint in .*step-00000004: files "
                                           r"\['__0_0.distcp'\] are missing or truncated"):
        read_weights(tmp_path / "step-00000004", wanted)


def test_a_format_1_replica_checkpoint_written_by_two_ranks(tmp_path: Path) -> None:
    """Format 1 (before DCP), read only: each rank's shard holds its own names; the reader takes them from both."""
    from tests.train_cases import small_cnn

    state = small_cnn().state_dict()
    names = list(state)
    files = {}
    step = tmp_path / "step-00000007"
    step.mkdir()
    for index, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = step / f"model-{index:05d}-of-00002.pt"
        torch.save({n: state[n] for n in part}, file)
        files[file.name] = {"sha256": "", "bytes": file.stat().st_size}
    (step / "manifest.json").write_text(json.dumps({"format": 1, "step": 7, "num_shards": 2,
                                                    "trainer": {}, "files": files}))
    assert_equal(read_weights(tmp_path, wanted_from(state)), state)
