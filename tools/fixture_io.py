"""What the HF-parity fixture makers share (tools/make_hf_fixtures.py for DeepSeek-V3,
tools/make_qwen3_fixtures.py for Qwen3 / Qwen3-MoE): the fixtures' place, the batch, the
router-choice hooks, the masked loss, the gradients by HF's file names, writing a fixture
directory, the ``--check-save`` round trip through mindtrain and the command line.

Runs in the reference venv with torch and transformers (never package dependencies); the
fixture makers import it as a sibling module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors.numpy import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(ROOT, "packages", "models", "tests", "fixtures")


def fixture_dir(name: str) -> str:
    """packages/models/tests/fixtures/hf_<name>."""
    return os.path.join(OUT, f"hf_{name}")


def random_batch(seed: int, vocab: int, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, labels, loss_mask)``: int64 ids and labels, a float32 mask keeping about 80%."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    labels = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    loss_mask = (rng.random((batch, seq)) > 0.2).astype(np.float32)
    return input_ids, labels, loss_mask


def record_choices(gates: dict[int, torch.nn.Module]) -> dict[int, torch.Tensor]:
    """Hook each MoE layer's router (``gates``: by layer index); the returned dict fills with
    its top-k expert indices (the router output's third entry) at each forward."""
    choices: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_module, _inputs, output):
            choices[idx] = output[2].detach()
        return fn

    for i, gate in gates.items():
        gate.register_forward_hook(hook(i))
    return choices


def busiest_experts(choices: dict[int, torch.Tensor], experts: int) -> dict[int, list[int]]:
    """Per MoE layer (``choices``: :func:`record_choices`), its experts from most to least
    chosen (ties by index): the ones whose gradients a fixture keeps."""
    return {i: list(np.argsort(-np.bincount(idx.numpy().reshape(-1), minlength=experts), kind="stable"))
            for i, idx in choices.items()}


def mark_no_qk_norm(out: str) -> None:
    """Add ``"qk_layernorm": false`` to the fixture ``out``'s config.json: the key mindtrain
    writes for a model without its q/k norms, which no HF class reads."""
    path = os.path.join(out, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["qk_layernorm"] = False
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def masked_loss(logits: torch.Tensor, labels: np.ndarray, loss_mask: np.ndarray, vocab: int) -> torch.Tensor:
    """The masked mean cross-entropy of ``logits`` against ``labels`` (aligned as mindtrain's are)."""
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(labels).reshape(-1),
                                           reduction="none")
    mask = torch.from_numpy(loss_mask).reshape(-1)
    return (ce * mask).sum() / mask.sum()


def reference(input_ids: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, logits: torch.Tensor) -> dict:
    """The reference entries every fixture has: the batch (int32 ids and labels) and the logits."""
    return {"input_ids": input_ids.astype(np.int32), "labels": labels.astype(np.int32), "loss_mask": loss_mask,
            "logits": logits.detach().numpy()}


def add_choices(ref: dict, choices: dict[int, torch.Tensor]) -> None:
    """``topk.<layer>``: each MoE layer's top-k choices, sorted per token."""
    for i, idx in choices.items():
        ref[f"topk.{i}"] = np.sort(idx.numpy(), -1).astype(np.int32)


def hf_grad(model, name: str, moe_inter: int) -> np.ndarray:
    """The gradient of parameter ``name`` as HF's checkpoint files name it: a per-expert name
    (``...mlp.experts.<e>.gate_proj.weight``) reads transformers' stacked tensors."""
    params = dict(model.named_parameters())
    if ".mlp.experts." in name:  # HF's per-expert file name -> transformers' stacked tensors
        prefix, e, proj, _ = name.rsplit(".", 3)
        e = int(e)
        if proj == "down_proj":
            return params[f"{prefix}.down_proj"].grad[e].numpy()
        gu = params[f"{prefix}.gate_up_proj"].grad[e].numpy()
        return gu[:moe_inter] if proj == "gate_proj" else gu[moe_inter:]
    return params[name].grad.numpy()


def add_grads(ref: dict, model, names: Sequence[str], moe_inter: int) -> None:
    """``grad.<HF name>`` for each of ``names`` (:func:`hf_grad`)."""
    for g in names:
        ref[f"grad.{g}"] = np.ascontiguousarray(hf_grad(model, g, moe_inter))


def write_fixture(name: str, model, ref: dict) -> str:
    """Write fixture ``name``: transformers' save_pretrained (config.json, model.safetensors;
    no generation_config.json) and reference.safetensors. Returns its directory."""
    out = fixture_dir(name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    return out


_MS_SAVE = """
import sys, mindspore as ms
ms.set_device('CPU')
import mindtrain.models as mm
m = mm.from_pretrained(sys.argv[1], jit=False)
m.save_pretrained(sys.argv[2])
"""


def check_save(name: str, load: Callable[[str], torch.nn.Module], ms_python: list[str], batch: int, seq: int,
               config_keys: Sequence[str] = ()) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads (``load(path)``) ->
    same logits as the fixture's model; ``config_keys`` must agree too. Returns the max
    |logits difference|."""
    src = fixture_dir(name)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "save.py")
        with open(script, "w") as f:
            f.write(_MS_SAVE)
        dst = os.path.join(tmp, "saved")
        subprocess.run(ms_python + [script, src, dst], check=True, cwd=ROOT)
        with open(os.path.join(dst, "config.json")) as f:
            print(f"{name}: mindtrain wrote config keys {sorted(json.load(f))[:6]}...")
        model = load(dst)
        ref = load(src)
        for key in config_keys:
            if getattr(ref.config, key, None) != getattr(model.config, key, None):
                raise SystemExit(f"{name}: config.{key} {getattr(model.config, key, None)!r} != "
                                 f"{getattr(ref.config, key, None)!r}")
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    print(f"{name}: mindtrain save_pretrained -> transformers from_pretrained, max |logits diff| {diff:.3g}")
    return diff


def main(description: str, names: Sequence[str], make: Callable[[str], None],
         check: Callable[[str, list[str]], float]) -> int:
    """The fixture makers' command line: ``make(name)`` each fixture (unless ``--only-check``),
    then with ``--check-save`` / ``--only-check`` ``check(name, ms_python)`` each."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check-save", action="store_true", help="also check mindtrain save_pretrained -> HF")
    ap.add_argument("--only-check", action="store_true", help="skip regenerating fixtures")
    ap.add_argument("--ms-python", default="hatch run python", help="command running the workspace Python")
    args = ap.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if not args.only_check:
        for name in names:
            make(name)
    if args.check_save or args.only_check:
        worst = max(check(name, args.ms_python.split()) for name in names)
        if worst > 1e-5:
            print("FAIL: logits differ", file=sys.stderr)
            return 1
        print("OK: transformers loads mindtrain's save_pretrained output with identical logits")
    return 0
