"""The model stays usable as itself while a manager holds it: ``model.generate`` and plain
forward passes get the model's original attention with the masks transformers makes for it
(causal, sliding windows, padding), and equal what they give outside any manager."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
import transformers as tf

import aiocb
from aiocb.runner.attention import _ORIGINALS, _configs, install, uninstall
from tests.conftest import _TINY

PROMPT = [(7 * i + 3) % 299 + 1 for i in range(40)]


def tiny(model_class: type, config_class: type, attention: str, **extra: object) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = config_class(**{**_TINY, "head_dim": 16, **extra}, attn_implementation=attention)
    model: tf.PreTrainedModel = model_class(config).eval()
    return model


MODELS: dict[str, Callable[[], tf.PreTrainedModel]] = {
    "llama-eager": lambda: tiny(tf.LlamaForCausalLM, tf.LlamaConfig, "eager"),
    "llama-sdpa": lambda: tiny(tf.LlamaForCausalLM, tf.LlamaConfig, "sdpa"),
    "mistral-sliding-sdpa": lambda: tiny(tf.MistralForCausalLM, tf.MistralConfig, "sdpa", sliding_window=16),
    "gemma3-hybrid-eager": lambda: tiny(
        tf.Gemma3ForCausalLM,
        tf.Gemma3TextConfig,
        "eager",
        sliding_window=16,
        sliding_window_pattern=2,
        final_logit_softcapping=None,
    ),
}


def plain_runs(model: tf.PreTrainedModel) -> tuple[list[list[int]], torch.Tensor]:
    """A left-padded batch through ``generate`` and one prompt's logits through ``model(...)``."""
    ids = torch.tensor([[0] * 30 + PROMPT[:10], PROMPT])
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0)
        logits = model(torch.tensor([PROMPT])).logits
    return generated[:, ids.shape[1] :].tolist(), logits


@pytest.mark.parametrize("name", list(MODELS))
async def test_generate_and_forward_while_a_manager_holds_the_model(name: str) -> None:
    model = MODELS[name]()
    before, logits_before = plain_runs(model)
    async with aiocb.Manager(model) as manager:
        during, logits_during = plain_runs(model)
        served = await manager.generate(PROMPT, max_new_tokens=10)  # the manager's own passes still work
    after, _ = plain_runs(model)
    assert during == before and after == before
    assert torch.equal(logits_during, logits_before)
    assert served.generated_tokens == before[1]


def test_a_model_dropped_while_installed_leaves_no_record_of_its_attention() -> None:
    """The mask function finds the original attention by the config's id: an entry must
    leave with its config, or a later config at the same id would inherit it."""
    model = MODELS["llama-eager"]()
    install(model)
    ids = {id(config) for config in _configs(model)}
    assert ids <= _ORIGINALS.keys()
    del model
    gc.collect()
    assert not ids & _ORIGINALS.keys()


def test_a_copy_of_a_held_model_defers_to_the_same_attention_as_it() -> None:
    """A copy made while aiocb holds a model (a draft made with ``copy.deepcopy``) names
    aiocb's attention in its config: held in turn, a plain call of it defers to what its
    modules came with, not to aiocb's mask function itself (endless recursion)."""
    model = MODELS["llama-eager"]()
    before = plain_runs(model)
    install(model)
    twin = copy.deepcopy(model)
    assert twin.config._attn_implementation == "aiocb_paged"

    def same_as_before() -> bool:
        generated, logits = plain_runs(twin)
        return generated == before[0] and torch.allclose(logits, before[1], atol=1e-5)

    assert same_as_before()  # (not held: the eager mask, which its eager attention needs)
    install(twin)
    assert same_as_before()
    uninstall(twin)
    assert twin.config._attn_implementation == "eager" and same_as_before()  # (what it came with)
    uninstall(model)
    assert model.config._attn_implementation == "eager"


def test_a_model_sharing_a_layer_is_routed_whichever_holder_comes_first() -> None:
    """A draft built from the target's layers carries the target's config on them: held
    first, it routes that config too (the shared layer reads it), and the target held
    next finds it routed; each config gets its own setting back with its last holder."""
    target = MODELS["llama-eager"]()
    torch.manual_seed(2)
    draft = tf.LlamaForCausalLM(tf.LlamaConfig(**{**_TINY, "head_dim": 16}, attn_implementation="sdpa")).eval()
    draft.model.layers[0] = target.model.layers[0]
    install(draft)
    assert target.config._attn_implementation == "aiocb_paged" == draft.config._attn_implementation
    install(target)
    uninstall(draft)
    assert target.config._attn_implementation == "aiocb_paged" and draft.config._attn_implementation == "sdpa"
    uninstall(target)
    assert target.config._attn_implementation == "eager"
