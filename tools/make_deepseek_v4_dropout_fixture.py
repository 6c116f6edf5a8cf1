"""Make the DeepSeek-V4 dropout references of mindtrain-models with HF transformers itself.

Run with the reference venv's Python (torch and transformers 5.24 are never package dependencies),
after tools/make_deepseek_v4_fixtures.py and tools/make_deepseek_v4_mla_fixtures.py:

    /tmp/fxvenv/bin/python tools/make_deepseek_v4_dropout_fixture.py

The fixtures' models, in training mode, on each fixture's batch, with the masks mindtrain
draws for training step STEP under training.seed SEED
(packages/models/src/mindtrain/models/dropout.py, read here with numpy in place of
MindSpore's Tensor): hf_deepseek_v4 (transformers' DeepseekV4ForCausalLM loaded from the
fixture's checkpoint: a sliding-window, two compressed sparse and a heavily compressed layer,
hyper-connection streams, attention sinks) and hf_deepseek_v4_mla (the ``mla`` variant as
make_deepseek_v4_mla_fixtures.py composes it: transformers' DeepseekV3Attention in V4's
layers, rebuilt and checked against the fixture's loss).

- attention dropout where transformers' attention applies it: on the probabilities after the
  softmax (V4's eager attention: over the keys and the sink, the sink's column dropped first,
  ``nn.functional.dropout(probs[..., :-1])``); the keys are the sequence's tokens (ids
  0..S-1), then V4's compressed entries (ids ENTRY_KEYS + w);
- hidden dropout, which transformers' V4 does not have, where MindFormers' PyNative
  ``HyperConnectionTransformerLayer`` applies ``hidden_states_dropout``: on the attention
  output and on the MoE output [B, S, H], before the hyper-connection streams' update (forward
  hooks on ``self_attn`` and ``mlp``).

Writes dropout.safetensors in each fixture directory: the rates, seed and step, the logits and
``loss`` (the masked mean cross-entropy) of that forward and the gradients of ``loss`` under
the names of the fixture's reference.safetensors.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV4ForCausalLM

import fixture_io as fx

NAMES = ("deepseek_v4", "deepseek_v4_mla")
ATTENTION, HIDDEN, SEED, STEP = 0.2, 0.3, 5, 1


def mindtrain_dropout():
    """mindtrain's dropout module (its masks as numpy arrays: Tensor is np.asarray here)."""
    stub = types.ModuleType("mindspore")
    stub.Tensor = np.asarray
    sys.modules.setdefault("mindspore", stub)
    path = os.path.join(fx.ROOT, "packages", "models", "src", "mindtrain", "models", "dropout.py")
    spec = importlib.util.spec_from_file_location("mindtrain_dropout", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(name: str, d: str):
    if name == "deepseek_v4_mla":
        from make_deepseek_v4_mla_fixtures import build

        return build()
    model = DeepseekV4ForCausalLM.from_pretrained(d, attn_implementation="eager", experts_implementation="eager")
    return model.float().eval()


def make(name: str, md) -> None:
    d = fx.fixture_dir(name)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    model = load_model(name, d)
    with torch.no_grad():  # the fixture's model: its reference loss without dropout
        plain = fx.masked_loss(model(torch.from_numpy(ref["input_ids"].astype(np.int64))).logits,
                               ref["labels"].astype(np.int64), ref["loss_mask"], model.config.vocab_size).item()
    assert abs(plain - ref["loss"].item()) < 1e-6, (plain, ref["loss"].item())
    model.config.attention_dropout = ATTENTION
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = ATTENTION
    model.train()

    state = md.Dropout(attention=ATTENTION, hidden=HIDDEN)
    state.begin_step(STEP, SEED)
    state.set_tokens(md.token_keys(ref["input_ids"]))
    current = {}
    used = {"attention": [], "hidden": []}

    def at_layer(i):
        def hook(_module, _args, _kwargs=None):
            current["layer"] = i
        return hook

    def drop_attention_output(i):
        def hook(_module, _args, output):
            out, weights = output
            mask = state.hidden_mask(i, md.HIDDEN_ATTENTION, tuple(out.shape))
            used["hidden"].append(i)
            return out * torch.from_numpy(mask), weights
        return hook

    def drop_moe_output(i):
        def hook(_module, _args, output):
            mask = state.hidden_mask(i, md.HIDDEN_MLP, tuple(output.shape))
            used["hidden"].append(i)
            return output * torch.from_numpy(mask)
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(at_layer(i))
        layer.self_attn.register_forward_hook(drop_attention_output(i))
        layer.mlp.register_forward_hook(drop_moe_output(i))

    plain_dropout = torch.nn.functional.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return plain_dropout(x, p, training, inplace)
        assert p == ATTENTION and x.dim() == 4, (p, tuple(x.shape))
        b, n, s, k = x.shape
        ids = np.concatenate((np.arange(s), md.ENTRY_KEYS + np.arange(k - s))).astype(np.uint64)
        mask = state.attention_mask_at(current["layer"], n, 0, ids[None, :])
        used["attention"].append(current["layer"])
        return x * torch.from_numpy(mask)

    torch.nn.functional.dropout = dropout
    try:
        logits = model(torch.from_numpy(ref["input_ids"].astype(np.int64))).logits
    finally:
        torch.nn.functional.dropout = plain_dropout
    n_layers = len(model.model.layers)
    assert used["attention"] == list(range(n_layers)), used
    assert sorted(used["hidden"]) == sorted(list(range(n_layers)) * 2), used
    loss = fx.masked_loss(logits, ref["labels"].astype(np.int64), ref["loss_mask"], model.config.vocab_size)
    loss.backward()

    out = {"attention_dropout": np.array(ATTENTION, np.float32), "hidden_dropout": np.array(HIDDEN, np.float32),
           "seed": np.array(SEED, np.int64), "step": np.array(STEP, np.int64), "logits": logits.detach().numpy(),
           "loss": np.array(loss.item(), np.float32)}
    fx.add_grads(out, model, [k[5:] for k in ref if k.startswith("grad.")], model.config.moe_intermediate_size)
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, os.path.join(d, "dropout.safetensors"))
    print(f"{name}: loss with dropout {loss.item():.6f} (without: {ref['loss'].item():.6f}), "
          f"wrote {os.path.join(d, 'dropout.safetensors')}")


def main() -> int:
    md = mindtrain_dropout()
    for name in NAMES:
        make(name, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
