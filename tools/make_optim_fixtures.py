"""Generate packages/trainer/tests/fixtures/adamw_torch.safetensors from torch.optim.AdamW.

Run in a separate venv (torch is never a package dependency):
    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 numpy safetensors
    /tmp/torchvenv/bin/python tools/make_optim_fixtures.py
"""

import os

import numpy as np
import torch
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "packages", "trainer", "tests", "fixtures",
                   "adamw_torch.safetensors")
SHAPES = {"model.layers.0.mlp.up_proj.weight": (16, 8), "model.layers.0.input_layernorm.weight": (8,),
          "lm_head.weight": (12, 8), "model.layers.0.self_attn.o_proj.bias": (8,)}
LRS = [1e-3, 2e-3, 5e-4, 1e-3, 1e-4, 3e-3]


def main() -> None:
    rng = np.random.default_rng(0)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: (rng.standard_normal(s) * 10 ** rng.uniform(-3, 1)).astype(np.float32)
              for n, s in SHAPES.items()} for _ in LRS]
    params = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in init.items()}
    decay = [p for n, p in params.items() if p.ndim >= 2]
    no_decay = [p for n, p in params.items() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LRS[0], betas=(0.9, 0.95), eps=1e-8)
    out = {f"init.{n}": v for n, v in init.items()}
    for i, (lr, g) in enumerate(zip(LRS, grads)):
        for group in opt.param_groups:
            group["lr"] = lr
        for n, p in params.items():
            p.grad = torch.from_numpy(g[n].copy())
        opt.step()
        for n, p in params.items():
            out[f"grad.{i}.{n}"] = g[n]
            out[f"param.{i}.{n}"] = p.detach().numpy().copy()
    out["lrs"] = np.array(LRS, np.float64)
    save_file(out, OUT, metadata={"torch": torch.__version__, "betas": "0.9,0.95", "eps": "1e-8",
                                  "weight_decay": "0.1"})
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
