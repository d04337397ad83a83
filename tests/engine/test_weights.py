"""Reference engine weights and checkpoint loader (`penelope.engine.weights`): seeded random
weights, tied heads, checkpoints saved by us and loaded by transformers, sharded and converted
loads, and the loader's errors."""
import json

import pytest
import torch
from engine_helpers import REFERENCE, TINY, UNTIED, full_prefill, hf_logits, random_tokens
from safetensors.torch import load_file, save_file

from penelope.engine.decoder import Qwen3Decoder
from penelope.engine.weights import (
    expected_shapes,
    load_checkpoint,
    random_weights,
    save_checkpoint,
    to_state_dict,
)
from penelope.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_random_weights_are_seeded_and_tied_head_is_the_embedding():
    a, b, c = random_weights(TINY, seed=3), random_weights(TINY, seed=3), random_weights(TINY, seed=4)
    pairs = zip(to_state_dict(TINY, a).values(), to_state_dict(TINY, b).values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.layers[0].q_proj, c.layers[0].q_proj)
    assert a.lm_head is a.embed
    untied = random_weights(UNTIED, seed=3)
    assert untied.lm_head is not untied.embed and untied.lm_head.shape == (UNTIED.vocab_size, UNTIED.hidden_size)
    assert set(to_state_dict(UNTIED, untied)) == set(expected_shapes(UNTIED))


def test_saved_checkpoint_loads_in_transformers_and_round_trips(tmp_path):
    from transformers import Qwen3ForCausalLM

    weights = random_weights(TINY, seed=5)
    save_checkpoint(tmp_path, TINY, weights)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head is loaded.embed
    assert all(
        torch.equal(x, y)
        for x, y in zip(to_state_dict(TINY, weights).values(), to_state_dict(TINY, loaded).values(), strict=True)
    )
    reference = Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = random_tokens(TINY, 48)
    ours, _ = full_prefill(Qwen3Decoder(TINY, loaded, attention=REFERENCE), tokens)
    assert (ours - hf_logits(reference, tokens)).abs().max() < 1e-4


def test_loader_splits_across_shards_and_converts_dtype(tmp_path):
    state = {k: v.contiguous() for k, v in to_state_dict(UNTIED, random_weights(UNTIED)).items()}
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(UNTIED.to_hf()))
    _, loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.dtype == torch.bfloat16
    assert torch.equal(loaded.layers[2].down_proj, state["model.layers.2.mlp.down_proj.weight"].bfloat16())


def _break_checkpoint(folder, how):
    file = folder / "model.safetensors"
    state = load_file(str(file))
    if how == "missing tensor":
        del state["model.layers.1.self_attn.k_norm.weight"]
    elif how == "wrong shape":
        state["model.norm.weight"] = torch.ones(3)
    elif how == "unexpected tensor":
        state["model.layers.0.mlp.extra.weight"] = torch.ones(3)
    elif how == "duplicate across shards":
        save_file({"model.norm.weight": state["model.norm.weight"]}, str(folder / "extra.safetensors"))
    save_file(state, str(file))


@pytest.mark.parametrize(
    "how, message",
    [
        ("no folder", "does not exist"),
        ("no config", "config.json"),
        ("no safetensors", "safetensors"),
        ("missing tensor", "k_norm"),
        ("wrong shape", "shape"),
        ("unexpected tensor", "extra"),
        ("duplicate across shards", "more than one file"),
        ("bad json", "JSON"),
    ],
)
def test_loader_errors(tmp_path, how, message):
    folder = save_checkpoint(tmp_path / "ckpt", UNTIED, random_weights(UNTIED))
    if how == "no folder":
        folder = tmp_path / "missing"
    elif how == "no config":
        (folder / "config.json").unlink()
    elif how == "no safetensors":
        (folder / "model.safetensors").unlink()
    elif how == "bad json":
        (folder / "config.json").write_text("{not json")
    else:
        _break_checkpoint(folder, how)
    with pytest.raises(UsageError, match=message):
        load_checkpoint(folder)
