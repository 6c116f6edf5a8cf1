"""What a config asks for that has no effect here: one line each, said once at start-up.

MindFormers' PyNative schema has fields for Ascend kernels, host binding and overlap tricks
that mindtrain does not have or that the device cannot honour. They are accepted (a MindFormers
config runs unchanged) and never silently ignored: rank 0 prints these lines.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mindtrain.config.schema import MindTrainConfig


# (section path, field, applies(value, device) -> bool, why it has no effect)
_Rule = tuple[str, str, Callable[[Any, str], bool], str]


def _set(value: Any, device: str) -> bool:
    return value not in (None, False, "", [], {})


def _on_cpu(value: Any, device: str) -> bool:
    return _set(value, device) and device.upper() == "CPU"


def _not_f32(value: Any, device: str) -> bool:
    return value not in (None, "float32")


RULES: list[_Rule] = [
    ("checkpoint", "load_balanced", _set, "every rank reads its own shards; balanced reading is not built"),
    ("checkpoint", "save_global_layout_cache", lambda v, d: v is False,
     "no global layout is cached (mindtrain writes the layout with every checkpoint)"),
    ("checkpoint", "reshard_worker_num", lambda v, d: v != 1, "resharding at load runs in one thread"),
    ("checkpoint", "load_worker_number", lambda v, d: v != 1,
     "each rank reads the files that hold its share in one thread"),
    ("parallelism", "context_parallel_async", _set, "context-parallel exchanges are synchronous"),
    ("parallelism", "pipeline_parallel_overlap_p2p", _set, "pipeline send/receive are not overlapped with compute"),
    ("parallelism", "pipeline_parallel_overlap_b_f", _set, "backward and forward of micro-batches are not overlapped"),
    ("parallelism", "pipeline_parallel_enable_dxdw_split", _set,
     "input and weight gradients are computed together"),
    ("parallelism", "pipeline_parallel_p2p_transport", lambda v, d: v != "plain",
     "pipeline send/receive use MindSpore's plain collectives"),
    ("parallelism", "enable_mc2", _set, "fused matmul+communication kernels (MC2) are Ascend graph kernels; "
                                        "eager collectives run instead"),
    ("parallelism", "expert_parallel_async_d2h", _set, "the expert token counts are copied to host synchronously"),
    ("parallelism", "expert_parallel_use_safe_tokens", lambda v, d: v is False,
     "mindtrain needs no safe tokens (empty expert groups are handled), so this has no effect"),
    ("parallelism", "param_dtype", _not_f32,
     "FSDP gathers the weights in their stored dtype (float32); compute runs in model.compute_dtype, "
     "and on CPU only float32 computes"),
    ("parallelism", "reduce_dtype", _not_f32,
     "gradients are reduced in float32 (as MindFormers' PyNative FSDP always does)"),
    ("parallelism", "npu_nums_per_device", lambda v, d: v != 8,
     "alltoall_deredundancy here sends each token once to each rank that holds any of its experts "
     "(MindFormers: once per device of npu_nums_per_device ranks), so it only checks expert_parallel"),
    ("train_dataset", "numa_enable", _set, "data workers are not bound to a NUMA node"),
    ("train_dataset", "use_distribute_dataset", _set,
     "every data-parallel rank reads its own batches (no read-once-and-broadcast)"),
    ("train_dataset.dataloader", "python_multiprocessing", _set, "samples are built in threads, not processes"),
    ("train_dataset.dataloader.config", "num_dataset_builder_threads", lambda v, d: v not in (None, 1),
     "the index arrays are built in one thread (and cached)"),
    ("model", "use_flash_attention", _on_cpu, "no FlashAttention kernel on CPU; the portable attention runs"),
    ("model", "expert_dtype", lambda v, d: v not in (None, "fp32", "float32"),
     "the routed experts' weights are float32 (no fp4 / fp8 expert kernels)"),
    ("optimizer", "use_fused_adamw", _set, "mindtrain's AdamW (and Muon's AdamW part) updates its flat "
                                           "parameter buffers in one pass either way"),
    ("model", "moe_grouped_gemm", _on_cpu, "no grouped-matmul kernel on CPU; experts run as batched matmuls"),
    ("model", "bias_swiglu_fusion", _on_cpu, "no fused SwiGLU kernel on CPU; silu(gate) * up runs"),
    ("model", "mla_qkv_concat", _set, "same math; mindtrain keeps DeepSeek-V3's separate q/kv down-projections "
                                      "(HF weight names)"),
    ("model", "apply_rope_fusion", _set, "no fused rotary kernel; the rotary embedding runs as plain ops"),
    ("model", "use_fused_ops_topkrouter", _set, "no fused top-k router kernel; the router runs as plain ops"),
    ("model", "use_attn_mask_compression", _set, "no compressed FlashAttention mask; causal masking is built in"),
    ("model", "layernorm_compute_dtype", _not_f32, "RMSNorm statistics are computed in float32"),
    ("model", "softmax_compute_dtype", _not_f32, "the attention softmax is computed in float32"),
    ("model", "rotary_dtype", _not_f32, "the rotary cos/sin tables are float32"),
    ("model", "router_dense_type", _not_f32, "the router's matmul runs in float32"),
    ("model", "moe_token_drop_policy", _set, "mindtrain drops no tokens (no expert capacity factor)"),
    ("model", "use_pad_tokens", _set, "expert inputs are not padded to a fixed size"),
    # context.max_device_memory on CPU: the runtime says so when it starts (mindtrain.trainer.runtime)
    ("profiler", "mstx", lambda v, d: v is True and d.upper() != "ASCEND", "mstx markers need Ascend"),
    ("profiler", "profile_memory", lambda v, d: v is True and d.upper() == "CPU",
     "the CPU profiler records no device memory"),
    ("recompute_comm", "enable", _set,
     "the communication of a recomputed tensor/expert-parallel region is recomputed with it "
     "(recompute.select_module names the regions); no communication is recomputed alone"),
    ("recompute", "exclude_op", _set, "operators are not kept out of recompute; whole modules recompute"),
    ("swap", "enable", _on_cpu, "on CPU activations already live in host memory (nothing to offload)"),
    ("parallelism", "cpu_offload", _on_cpu,
     "on CPU the FSDP shards and the optimizer state already live in host memory (nothing to offload)"),
    # swap.enable on Ascend/GPU is refused (mindtrain.config.validate.validate_device)
]


def _get(cfg: Any, section: str) -> Any:
    node = cfg
    for part in section.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def startup_notes(cfg: MindTrainConfig, device: str) -> list[str]:
    """One line per field the user set that has no effect on ``device`` or in mindtrain."""
    notes = []
    for section, name, applies, why in RULES:
        node = _get(cfg, section)
        if node is None or not dataclasses.is_dataclass(node) or not hasattr(node, name):
            continue
        value = getattr(node, name)
        if applies(value, device):
            notes.append(f"{section}.{name}={_show(value)} has no effect: {why}")
    p = cfg.parallelism
    if p.ulysses_degree_in_cp is not None and (p.context_parallel_method == "colossal" or p.context_parallel == 1):
        # as MindFormers, which reads the degree only for ulysses / hybrid with context_parallel > 1
        notes.append(f"parallelism.ulysses_degree_in_cp={p.ulysses_degree_in_cp} has no effect: it applies to "
                     f"context_parallel_method ulysses or hybrid with context_parallel > 1")
    return notes


def _show(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)
