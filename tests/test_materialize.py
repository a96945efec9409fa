"""Tests for replica.materialize: meta models get storage, the same weights for any layout."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import replica
from examples.gpt.model import GPT, GPTConfig
from replica.errors import ConfigError
from replica.materialize import deferred_init, materialize, materialize_modules
from tests.grads import assert_same_grads
from tests.models import TinyGPT

transformers = pytest.importorskip("transformers")


def owner_paths(model: nn.Module) -> list[str]:
    """Paths of the modules that directly own a parameter or buffer, in named_modules order."""
    return [
        p for p, m in model.named_modules()
        if any(t is not None for t in [*m._parameters.values(), *m._buffers.values()])
    ]


def owned(model: nn.Module, paths: list[str]) -> dict[str, Tensor]:
    """Every tensor the modules at ``paths`` directly own, by full name."""
    out = {}
    for path in paths:
        module = model.get_submodule(path)
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out[f"{path}.{name}" if path else name] = t
    return out


def assert_same_forward_backward(model: nn.Module, ref: nn.Module, ids: Tensor) -> None:
    """Same logits and the same .grad on every parameter, as the plain model."""
    outs = []
    for m in (model, ref):
        m.eval().zero_grad()
        logits = m(ids)
        logits = logits if isinstance(logits, Tensor) else logits.logits
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        outs.append(logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert_same_grads(model, ref)


def load_parameters(model: nn.Module, ref: nn.Module) -> None:
    """Only parameters: every buffer must come from materialize itself."""
    result = model.load_state_dict(dict(ref.named_parameters()), strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    assert set(result.missing_keys) <= buffers | tied, result.missing_keys
    assert not result.unexpected_keys


# --------------------------------------------------------------------------- model builders


def gpt2(device: str | None = None) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    with torch.device(device) if device else _nothing():
        return transformers.GPT2LMHeadModel(cfg)


def llama(device: str | None = None, *, tied: bool = False) -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=32, tie_word_embeddings=tied,
                                   attn_implementation="eager")
    with torch.device(device) if device else _nothing():
        return transformers.LlamaForCausalLM(cfg)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def example_gpt(device: str | None = None) -> nn.Module:
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    with torch.device(device) if device else _nothing():
        return GPT(cfg)


def hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    return model._init_weights  # type: ignore[no-any-return]


# Each case: (build on meta or deferred, init for the built model)
LAYOUT_CASES: dict[str, Callable[[], tuple[nn.Module, Callable[[nn.Module], None] | None]]] = {
    "tiny_gpt_deferred": lambda: (_deferred(TinyGPT), None),
    "example_gpt_meta": lambda: (lambda m: (m, m._init_weights))(example_gpt("meta")),
    "gpt2_meta": lambda: (lambda m: (m, hf_init(m)))(gpt2("meta")),
    "llama_meta_tied": lambda: (lambda m: (m, hf_init(m)))(llama("meta", tied=True)),
}


def _deferred(build: Callable[[], nn.Module]) -> nn.Module:
    with deferred_init():
        return build()


# --------------------------------------------------------------------------- buffers computed in __init__


def test_plain_meta_model_names_the_buffers_it_lost() -> None:
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.raises(ConfigError, match="deferred_init") as err:
        materialize(model)
    for name in ("pos (TinyGPT)", "transformer.h.0.attn.bias", "transformer.h.1.attn.bias"):
        assert name in str(err.value)


def test_deferred_init_keeps_buffers_real_and_parameters_on_meta() -> None:
    with deferred_init():
        model = TinyGPT()
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert nn.Module.register_parameter.__name__ == "register_parameter"
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_tiny_gpt_deferred_matches_the_plain_model() -> None:
    ref = TinyGPT()
    with deferred_init():
        model = TinyGPT()
    assert materialize(model, seed=3) is model
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name
    load_parameters(model, ref)
    assert_same_forward_backward(model, ref, torch.randint(0, 64, (2, 16)))


@pytest.mark.parametrize("build", [gpt2, llama, lambda d=None: llama(d, tied=True)], ids=["gpt2", "llama", "llama_tied"])
def test_hf_meta_model_matches_the_plain_model(build: Callable[..., nn.Module]) -> None:
    ref = build()
    model = build("meta")
    materialize(model, init=model._init_weights, seed=0)
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    for name, b in ref.named_buffers():  # HF's _init_weights recomputes rotary inv_freq
        torch.testing.assert_close(model.get_buffer(name), b, rtol=0, atol=0, msg=name)
    load_parameters(model, ref)
    assert_same_forward_backward(model, ref, torch.randint(0, 128, (2, 8)))


def test_hf_llama_deferred_matches_the_plain_model() -> None:
    ref = llama()
    with deferred_init():
        model = llama()
    materialize(model, init=model._init_weights, seed=0)
    load_parameters(model, ref)
    assert_same_forward_backward(model, ref, torch.randint(0, 128, (2, 8)))


# --------------------------------------------------------------------------- independent of the layout


def groups_of(paths: list[str], num_groups: int, interleaved: bool) -> list[list[str]]:
    if interleaved:
        return [paths[i::num_groups] for i in range(num_groups)]
    size = -(-len(paths) // num_groups)
    return [paths[i : i + size] for i in range(0, len(paths), size)]


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("num_groups", [1, 2, 4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_split_gives_bitwise_the_same_weights(case: str, num_groups: int, interleaved: bool) -> None:
    whole, init = LAYOUT_CASES[case]()
    materialize(whole, init=init, seed=1234)
    expected = owned(whole, owner_paths(whole))
    for group in groups_of(owner_paths(whole), num_groups, interleaved):  # one fresh model per rank
        model, init = LAYOUT_CASES[case]()
        materialize_modules(model, group, init=init, seed=1234)
        mine = owned(model, group)
        for name, t in mine.items():
            assert torch.equal(t, expected[name]), name
        others = set(owner_paths(model)) - set(group)
        for name, t in owned(model, sorted(others)).items():  # deferred buffers are real anyway
            if isinstance(t, nn.Parameter):
                assert t.is_meta or any(t is u for u in mine.values()), name


@pytest.mark.parametrize("case", ["tiny_gpt_deferred", "llama_meta_tied"])
def test_groups_in_turn_on_one_model_equal_the_whole(case: str) -> None:
    whole, init = LAYOUT_CASES[case]()
    materialize(whole, init=init, seed=5)
    model, init = LAYOUT_CASES[case]()
    for group in reversed(groups_of(owner_paths(model), 4, interleaved=True)):
        materialize_modules(model, group, init=init, seed=5)
    expected = dict(whole.state_dict(keep_vars=True))
    for name, t in model.state_dict(keep_vars=True).items():
        assert torch.equal(t, expected[name]), name
    embedding = model.transformer.wte if case == "tiny_gpt_deferred" else model.model.embed_tokens
    assert model.lm_head.weight is embedding.weight


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_a_tied_parameter_takes_its_first_owners_value_wherever_it_lives() -> None:
    with torch.device("meta"):
        whole, part = TiedPair(), TiedPair()
    materialize(whole, seed=9)
    materialize_modules(part, ["b"], seed=9)  # a rank holding only b
    assert part.b.weight is part.a.weight and not part.b.weight.is_meta
    assert torch.equal(part.b.weight, whole.a.weight)
    assert torch.equal(part.b.bias, whole.b.bias)
    assert part.a.bias.is_meta  # a was initialized for the tie only, then put back


# --------------------------------------------------------------------------- seeds and RNG


def test_materialize_draws_one_number_from_the_global_generator() -> None:
    with torch.device("meta"):
        model = TinyPair()
    torch.manual_seed(11)
    materialize(model)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    seed = int(torch.randint(2**62, ()).item())
    assert torch.equal(after, torch.get_rng_state())
    with torch.device("meta"):
        again = TinyPair()
    materialize(again, seed=seed)
    assert torch.equal(model.a.weight, again.a.weight)


def test_materialize_modules_leaves_the_global_generator_alone() -> None:
    with torch.device("meta"):
        model = TinyPair()
    before = torch.get_rng_state()
    materialize_modules(model, ["a", "b"], seed=1)
    assert torch.equal(before, torch.get_rng_state())


def test_another_seed_gives_other_weights() -> None:
    with torch.device("meta"):
        x, y = TinyPair(), TinyPair()
    materialize(x, seed=1)
    materialize(y, seed=2)
    assert not torch.equal(x.a.weight, y.a.weight)
    assert not torch.equal(x.a.weight, x.b.weight)  # each module its own stream


class TinyPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def test_modules_with_private_reset_parameters_are_initialized() -> None:
    with torch.device("meta"):
        model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    materialize(model, seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------------------- errors


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)


def test_a_module_without_reset_parameters_needs_init() -> None:
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ConfigError, match=r"<root> \(Scaled\).*init="):
        materialize(model)
    materialize(model, init=lambda m: nn.init.ones_(m.scale) if isinstance(m, Scaled) else None, seed=0)
    assert torch.equal(model.scale, torch.ones(3))


def test_an_init_that_leaves_a_parameter_unset_is_named() -> None:
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ConfigError, match=r"parameters scale \(Scaled\)"):
        materialize(model, init=lambda m: None, seed=0)


def test_nothing_to_materialize() -> None:
    with pytest.raises(ConfigError, match="no tensor on the meta device"):
        materialize(TinyPair())


def test_unknown_and_empty_paths() -> None:
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.raises(ConfigError, match="no module 'transformer.h.7'"):
        materialize_modules(model, ["transformer.h.7"], seed=0)
    with pytest.raises(ConfigError, match=r"'transformer.h.0' \(Block\) owns no parameter.*ln_1"):
        materialize_modules(model, ["transformer.h.0"], seed=0)
    with pytest.raises(ConfigError, match="device='meta'"):
        materialize_modules(model, ["lm_head"], device="meta", seed=0)


# --------------------------------------------------------------------------- weights by name


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2-tied", "llama"])
def test_meta_model_loads_save_pretrained_weights(tmp_path, build) -> None:
    """A Hugging Face model built on meta and materialized with ``weights=`` (no init needed:
    the file sets every parameter, _init_weights only recomputes rotary buffers) gives the
    saved model's logits and gradients."""
    torch.manual_seed(0)
    saved = build()
    saved.save_pretrained(tmp_path, max_shard_size="20KB")  # a sharded index
    model = build("meta")
    replica.materialize(model, init=model._init_weights if isinstance(model, transformers.LlamaForCausalLM) else None,
                        weights=tmp_path)
    assert dict(model.named_parameters()).keys() == dict(saved.named_parameters()).keys()
    ids = torch.randint(0, 128, (2, 16))
    model.eval(), saved.eval()  # no dropout
    out, ref = model(ids).logits, saved(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().mean().backward()
    ref.square().mean().backward()
    assert_same_grads(model, saved)


def test_weights_that_do_not_fit_say_so_before_anything_is_loaded(tmp_path) -> None:
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                   n_positions=32))
    other.save_pretrained(tmp_path)
    model = gpt2("meta")
    with pytest.raises(replica.ReplicaError, match="shape"):
        replica.materialize(model, weights=tmp_path)
