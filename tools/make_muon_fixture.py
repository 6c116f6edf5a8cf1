"""Reference fixture for mindtrain's Muon: torch.optim.Muon (torch 2.13) on small fixed
matrices for three steps, saved to packages/trainer/tests/fixtures/muon_torch.npz.

Run with a torch venv (python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install
torch==2.13.0 'numpy<2' safetensors): ``/tmp/hfvenv/bin/python tools/make_muon_fixture.py``.

Settings matched to ``optimizer.type: Muon``: lr 0.02, weight_decay 0.1, momentum 0.95,
ns_coefficients (3.4445, -4.7750, 2.0315), ns_steps 5, eps 1e-7, and
``adjust_lr_fn="match_rms_adamw"`` (lr * 0.2 * sqrt(max(A, B)): matched_adamw_rms 0.2, what
MindFormers and Moonlight do; torch's default "original" is Keller Jordan's sqrt(max(1, A/B))).
Nesterov on and off (two runs). Two differences from MindFormers, both handled here:
  - torch's Newton-Schulz casts to bfloat16; this tool runs torch's own function with that
    cast removed (a source edit of ``_zeropower_via_newtonschulz``) and in float64, so the
    fixture is the algorithm's value, not bfloat16 noise;
  - torch keeps its buffer as an exponential average (buf.lerp_(g, 1 - momentum)), which is
    (1 - momentum) times MindFormers' m = momentum * m + g; Newton-Schulz normalises its input,
    so the updates agree (up to eps: torch clamps the norm at eps, MindFormers adds eps). The
    fixture stores torch's buffers; the test compares (1 - momentum) * m.
"""

import inspect
import os
import textwrap

import numpy as np
import torch
import torch.optim._muon as torch_muon

OUT = os.path.join(os.path.dirname(__file__), "..", "packages", "trainer", "tests", "fixtures", "muon_torch.npz")
SHAPES = {"wide": (6, 10), "tall": (12, 5), "square": (8, 8)}
STEPS = 3
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5,
                eps=1e-7, adjust_lr_fn="match_rms_adamw")


def _float_newton_schulz():
    """torch's _zeropower_via_newtonschulz without its bfloat16 cast."""
    src = textwrap.dedent(inspect.getsource(torch_muon._zeropower_via_newtonschulz))
    assert "grad.bfloat16()" in src
    namespace = dict(vars(torch_muon))
    exec(src.replace("grad.bfloat16()", "grad.clone()"), namespace)
    return namespace["_zeropower_via_newtonschulz"]


def main() -> None:
    torch_muon._zeropower_via_newtonschulz = _float_newton_schulz()
    rng = np.random.default_rng(31)
    out = {}
    for name, shape in SHAPES.items():
        out[f"init.{name}"] = rng.standard_normal(shape).astype(np.float32)
        for step in range(STEPS):
            out[f"grad{step}.{name}"] = rng.standard_normal(shape).astype(np.float32)
    for nesterov in (True, False):
        tag = "nesterov" if nesterov else "plain"
        params = {n: torch.nn.Parameter(torch.tensor(out[f"init.{n}"], dtype=torch.float64)) for n in SHAPES}
        opt = torch.optim.Muon(list(params.values()), nesterov=nesterov, **SETTINGS)
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = torch.tensor(out[f"grad{step}.{n}"], dtype=torch.float64)
            opt.step()
            for n, p in params.items():
                out[f"{tag}.param{step}.{n}"] = p.detach().numpy().astype(np.float64)
                out[f"{tag}.buf{step}.{n}"] = opt.state[p]["momentum_buffer"].numpy().astype(np.float64)
    out["torch_version"] = np.array(torch.__version__)
    np.savez_compressed(OUT, **out)
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes), torch {torch.__version__}")


if __name__ == "__main__":
    main()
