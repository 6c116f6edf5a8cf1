"""One process: the same small DeepSeek-V3 forward + backward eager, compiled by whole layers
and compiled by regions (``apply_compile(model, granularity="region")``, what TP/EP/CP run).

    hatch run python benchmarks/probe_regions.py            # runs each mode in its own process

Prints per mode the first step (compile) and the median of the next seven steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

MODES = ("eager", "auto", "region")


def one(mode: str) -> None:
    import numpy as np

    import mindspore as ms

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    from mindspore import Tensor

    import mindtrain.models as mm
    from mindtrain.config import ModelConfig

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                      q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, seq_length=256,
                      max_position_embeddings=512, num_nextn_predict_layers=1, n_shared_experts=1)
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 512, (1, 256)).astype(np.int32))
    labels = Tensor(rng.randint(0, 512, (1, 256)).astype(np.int32))
    ms.set_seed(0)
    model = mm.build_model(cfg, jit=False)
    if mode != "eager":
        mm.apply_compile(model, granularity=mode)

    def loss_fn(i, l):
        return model(i, labels=l)[0]

    step = ms.value_and_grad(loss_fn, None, model.trainable_params())
    times = []
    for _ in range(8):
        t = time.perf_counter()
        loss, _ = step(ids, labels)
        loss.asnumpy()
        times.append(time.perf_counter() - t)
    print(f"{mode}: first step {times[0]:.2f} s, then {1000 * float(np.median(times[1:])):.0f} ms/step "
          f"(loss {float(loss.asnumpy()):.6f})", flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        one(sys.argv[1])
        return 0
    for mode in MODES:
        subprocess.run([sys.executable, os.path.abspath(__file__), mode], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
