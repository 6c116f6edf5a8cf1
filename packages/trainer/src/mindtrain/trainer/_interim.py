"""Stand-ins used only while mindtrain.data / mindtrain.models do not export these yet.

Each is replaced by the sibling package's public API as soon as it lands; nothing here is
public.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

import numpy as np


def byte_preprocess(jsonl: str, output_prefix: str) -> str:
    """jsonl {"text"} -> <prefix>_text_document.bin/.idx, byte b -> b + 3, EOD (1) appended."""
    from mindtrain.data import IndexedDatasetBuilder

    out = output_prefix + "_text_document"
    builder = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            ids = np.frombuffer(json.loads(line)["text"].encode("utf-8"), np.uint8).astype(np.uint16) + 3
            ids = np.append(ids, 1)
            builder.add_document(ids, [len(ids)])
    builder.finalize(out + ".idx")
    return out


class MegatronOrderLoader:
    """Megatron's pretraining sampler order: micro-batch groups of mbs x dp consecutive
    samples, rank r taking slice r."""

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 drop_remainder: bool = True, num_workers: int = 0, shuffle: bool = False, seed: int = 0):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = 0

    def __iter__(self) -> Iterator[dict]:
        n = len(self.dataset)
        group = self.mbs * self.dp_size
        while True:
            start = self.consumed_samples % (n - n % group)
            idx = range(start + self.dp_rank * self.mbs, start + (self.dp_rank + 1) * self.mbs)
            samples = [self.dataset[i] for i in idx]
            self.consumed_samples += group
            yield {k: np.stack([s[k] for s in samples]) for k in samples[0]}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def flops_per_token(cfg, seq_length: int) -> float:
    """6 x active matmul parameters + attention, per token (forward + backward)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    q = (h * cfg.q_lora_rank + cfg.q_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
         if cfg.q_lora_rank else h * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * cfg.num_attention_heads * (
        cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = cfg.num_attention_heads * cfg.v_head_dim * h
    dense = 3 * h * cfg.intermediate_size
    moe = 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + h * cfg.n_routed_experts
    layers = (q + kv + o) * (L + cfg.num_nextn_predict_layers) + dense * cfg.first_k_dense_replace + moe * (
        L - cfg.first_k_dense_replace + cfg.num_nextn_predict_layers)
    attn = cfg.num_attention_heads * seq_length * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * (
        L + cfg.num_nextn_predict_layers)
    head = h * cfg.vocab_size * (1 + cfg.num_nextn_predict_layers)
    return 6.0 * (layers + head) + 6.0 * attn


def build_model(cfg, jit: Optional[bool] = None):
    from mindtrain.models.deepseek_v3 import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(cfg, jit=bool(jit))
