"""A copying circuit set into a Qwen3's weights before training, and held there.

A model that copies from its context (an *induction head*: attend to the token that
followed an earlier occurrence of the current token, and predict it again) is what makes
prompt-lookup speculation pay. Language models learn one only after far more training than
``train_default_model.py`` gets on a CPU in half an hour: trained from scratch, with or
without copy-heavy data, the bundled model never formed one. So the training starts with
the circuit written into a few weights, by hand, and puts them back after every optimizer
step; the rest of the model learns around it (and to use it).

Two heads, each the first of its layer (query head 0 and the key/value head it reads):

* **Layer 0, the previous token.** Its queries and keys read one residual dimension that
  every token embedding holds at the same value (``CONSTANT``), so they are the same for
  every token; their rotary pairs are phased so that a query meets its best key exactly
  one position back. The head's values are a random projection (24 dimensions) of the
  token's embedding, which it writes into 24 residual dimensions that nothing else writes
  (``CARRIED``): each position then carries a sketch of the token before it.
* **Layer 1, the match.** Its queries project the current token the same way, its keys
  read the carried sketch, both in the slowest rotary pairs (rope theta 1e6: they turn by
  under 0.2 radians across the 1,024-token context), so a query meets the keys of the
  positions whose previous token equals its own token. Its values project that position's
  own token, and its output adds the token's embedding back (the head is tied to the
  vocabulary through the embedding), raising the logit of the token that followed.

Held in place: those weights, the query and key norms of layers 0 and 1 (shared by their
other heads), their input norms, the reserved embedding columns (``CONSTANT`` fixed,
``CARRIED`` zero), and zero rows into the reserved dimensions in every other output
projection. On random token sequences written twice, the circuit alone (every other head
and MLP silenced, nothing trained) predicts 95-98% of the second copy's tokens.
"""

from __future__ import annotations

import math

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

#: the rotary base the circuit's match needs (Qwen3's own default)
ROPE_THETA = 1e6
#: dimensions of the token sketches the circuit compares
SKETCH = 24
#: rotary pairs of the previous-token head (the fastest) and of the match (the slowest)
_FAST_PAIRS = range(0, 12)
_SLOW_PAIRS = range(20, 32)
#: the embedding value of the constant dimension (about an entry's scale at initialization)
_CONSTANT_VALUE = 0.02
#: sharpness of the two heads (their query and key norms' weights on the pairs they use)
_PREVIOUS_SHARPNESS = 3.0
_MATCH_SHARPNESS = 2.0
#: how strongly the match head raises the copied token
_COPY_GAIN = 4.0

#: what to hold: parameter name -> (which entries, their values)
Circuit = dict[str, tuple[torch.Tensor, torch.Tensor]]


def layout(config: Qwen3Config) -> tuple[int, list[int], list[int]]:
    """The residual's reserved dimensions: the constant one, the carried sketch, and the
    token dimensions (all the others)."""
    hidden = int(config.hidden_size)
    constant = hidden - 1
    carried = list(range(hidden - 1 - SKETCH, hidden - 1))
    return constant, carried, list(range(hidden - 1 - SKETCH))


def copying_circuit(config: Qwen3Config, seed: int) -> Circuit:
    """The circuit's weights for a model of ``config`` (see the module's docstring)."""
    dim = int(config.head_dim)
    half = dim // 2
    theta = float(dict(config.rope_parameters or {}).get("rope_theta", 0.0))
    if theta != ROPE_THETA or config.num_hidden_layers < 2 or dim != 64:
        raise ValueError(f"the copying circuit needs head_dim 64, 2+ layers and rope theta {ROPE_THETA:g}")
    hidden, heads, kv_heads = (
        int(config.hidden_size),
        int(config.num_attention_heads),
        int(config.num_key_value_heads or config.num_attention_heads),
    )
    constant, carried, token = layout(config)
    reserved = [*carried, constant]
    generator = torch.Generator().manual_seed(seed)
    sketch = torch.randn(SKETCH, len(token), generator=generator) / math.sqrt(len(token))
    readout = torch.randn(dim, len(token), generator=generator) / math.sqrt(len(token))
    frequency = [theta ** (-2 * i / dim) for i in range(half)]
    circuit: Circuit = {}

    def hold(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        entries = torch.zeros(shape, dtype=torch.bool)
        values = torch.zeros(shape)
        circuit[name] = (entries, values)
        return entries, values

    def norm(name: str, pairs: range, sharpness: float) -> None:
        entries, values = hold(name, (dim,))
        entries[:] = True
        values[:] = 1.0
        for i in pairs:
            values[i] = values[i + half] = sharpness

    def first_head(layer: int) -> tuple[torch.Tensor, ...]:
        """Hold query head 0 of ``layer`` and the key/value head it reads (every weight, zero
        unless set), and the head's output columns (and the reserved rows of its layer)."""
        attention = f"model.layers.{layer}.self_attn"
        held = []
        for name, count in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            entries, values = hold(f"{attention}.{name}.weight", (count * dim, hidden))
            entries[:dim] = True
            held.append(values)
        entries, output = hold(f"{attention}.o_proj.weight", (hidden, heads * dim))
        entries[:, :dim] = True
        entries[reserved] = True
        return (*held, output)

    # Layer 0: the previous token.
    query, key, value, output = first_head(0)
    for i in _FAST_PAIRS:
        # A key turned one position ahead of the query: their rotations meet at a distance of 1.
        query[i, constant] = 1.0
        key[i, constant], key[i + half, constant] = math.cos(frequency[i]), math.sin(frequency[i])
    value[:SKETCH, token] = sketch
    for k, d in enumerate(carried):
        output[d, k] = 1.0
    norm("model.layers.0.self_attn.q_norm.weight", _FAST_PAIRS, _PREVIOUS_SHARPNESS)
    norm("model.layers.0.self_attn.k_norm.weight", _FAST_PAIRS, _PREVIOUS_SHARPNESS)

    # Layer 1: the match.
    query, key, value, output = first_head(1)
    slow = [*_SLOW_PAIRS, *(i + half for i in _SLOW_PAIRS)]
    for k, d in enumerate(slow):
        query[d, token] = sketch[k]
        key[d, carried[k]] = 1.0
    value[:dim, token] = readout
    output[token, :dim] = _COPY_GAIN * readout.T
    norm("model.layers.1.self_attn.q_norm.weight", _SLOW_PAIRS, _MATCH_SHARPNESS)
    norm("model.layers.1.self_attn.k_norm.weight", _SLOW_PAIRS, _MATCH_SHARPNESS)

    # Nothing else writes the reserved dimensions; the circuit's layers read unscaled input.
    for layer in range(config.num_hidden_layers):
        for name, columns in (("self_attn.o_proj", heads * dim), ("mlp.down_proj", int(config.intermediate_size))):
            if f"model.layers.{layer}.{name}.weight" not in circuit:
                entries, _ = hold(f"model.layers.{layer}.{name}.weight", (hidden, columns))
                entries[reserved] = True
        if layer < 2:
            entries, values = hold(f"model.layers.{layer}.input_layernorm.weight", (hidden,))
            entries[:] = True
            values[:] = 1.0
    entries, values = hold("model.embed_tokens.weight", (config.vocab_size, hidden))
    entries[:, reserved] = True
    values[:, constant] = _CONSTANT_VALUE
    return circuit


@torch.no_grad()
def hold_circuit(model: Qwen3ForCausalLM, circuit: Circuit) -> None:
    """Write the circuit's entries into ``model`` (after every optimizer step)."""
    parameters = dict(model.named_parameters())
    for name, (entries, values) in circuit.items():
        parameters[name][entries] = values[entries]
