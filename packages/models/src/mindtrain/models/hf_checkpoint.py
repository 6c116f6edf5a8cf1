"""HF-format model directories: config.json + safetensors (one file, or shards + index).

Routed experts live stacked in the model (``mlp.experts.gate_proj [E, I, H]``); files use the
official per-expert names (``mlp.experts.{e}.gate_proj.weight``). Loading also accepts the
stacked layout transformers 5.x uses in memory (``experts.gate_up_proj`` / ``experts.down_proj``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable, Optional

import numpy as np
from mindspore import Tensor, ops

from mindtrain.config import ConfigError, UserError, validate_model
from mindtrain.models.hf_v4_names import file_to_model, model_to_file
from mindtrain.models.hf_config import config_from_hf, config_to_hf, refuse_without_hf_equivalent
from mindtrain.models.registry import build_model

log = logging.getLogger(__name__)

_EXPERT_FILE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_V5 = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_MTP_COPIES = re.compile(r"^model\.layers\.(\d+)\.(embed_tokens\.weight|shared_head\.head\.weight)$")


def hf_tensor_names(name: str, shape, model_type: str = "deepseek_v3") -> list[tuple[str, Optional[int]]]:
    """The HF checkpoint tensors a model parameter is stored as: ``[(name, None)]``, or for
    stacked routed experts one per expert, ``(per-expert name, expert index)``. DeepSeek-V4's
    files use the released checkpoints' names (:mod:`mindtrain.models.hf_v4_names`)."""
    if model_type == "deepseek_v4":
        return model_to_file(name, shape)
    m = _STACKED.match(name)
    if m:
        return [(f"{m.group(1)}.{e}.{m.group(2)}.weight", e) for e in range(int(shape[0]))]
    return [(name, None)]


def hf_copies(cfg) -> list[tuple[str, str]]:
    """``(copy, source)``: the MTP modules' copies of the shared embedding and head that the
    official checkpoint stores (``model.layers.{L+k}.embed_tokens.weight``, ...); DeepSeek-V4's
    (whose head is ``head.weight`` in files) none: its MTP modules read the model's own."""
    out = []
    if getattr(cfg, "model_type", "deepseek_v3") == "deepseek_v4":
        return out
    for k in range(cfg.num_nextn_predict_layers):
        idx = cfg.num_hidden_layers + k
        out += [(f"model.layers.{idx}.embed_tokens.weight", "model.embed_tokens.weight"),
                (f"model.layers.{idx}.shared_head.head.weight", "lm_head.weight")]
    return out


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """The model's weights under HF checkpoint names (float32 numpy arrays), MTP copies
    included (:func:`hf_copies`)."""
    out: dict[str, np.ndarray] = {}
    model_type = model.config.model_type
    for p in model.get_parameters():
        arr = p.asnumpy()
        if p.name.endswith(".tid2eid"):  # DeepSeek-V4's token -> experts table: integer ids in files
            arr = arr.astype(np.int64)
        for hf_name, e in hf_tensor_names(p.name, arr.shape, model_type):
            out[hf_name] = arr if e is None else np.ascontiguousarray(arr[e])
    for copy, source in hf_copies(model.config):
        out[copy] = out[source]
    return out


def load_hf_state_dict(model, tensors: dict[str, np.ndarray], source: str = "checkpoint",
                       allow_missing_mtp: bool = True, in_place: bool = True) -> None:
    """Copy HF-named arrays into the model; missing or mis-shaped weights are a UserError.

    ``in_place`` (default) writes each parameter's existing buffer (``ops.assign``), which
    layers compiled earlier read. A model that has not run yet and will be laid out next
    (sharded with ``set_data``) must use ``in_place=False``: fresh storage per parameter. In
    MindSpore 2.10 a parameter once written by ``ops.assign`` keeps that buffer for its
    kernels, so a later ``set_data`` (a tensor-parallel or FSDP shard) is not seen by them
    (``ops.gather`` then reads the old full-size weight)."""
    params = {p.name: p for p in model.get_parameters()}
    boxes = HFBoxes(source, model.config, {n: tuple(p.shape) for n, p in params.items()}, tensors=tensors,
                    allow_missing_mtp=allow_missing_mtp)
    boxes.check_shapes((n, tuple(p.shape)) for n, p in params.items())
    for name in boxes.names():
        value = Tensor(boxes.read_full(name))
        if in_place:  # the existing buffer, which already-compiled (jit) layers read
            ops.assign(params[name], value)
        else:
            params[name].set_data(value)


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="np") as f:
        for key in f.keys():
            arr = f.get_tensor(key)
            out[key] = arr if arr.dtype == np.float32 else arr.astype(np.float32)
    return out


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
    """All tensors of an HF directory as float32: the shards model.safetensors.index.json
    names, else every ``*.safetensors`` file (model.safetensors, or shards without an
    index). The one HF reader (from_pretrained and a trainer's checkpoint.load_path);
    pickle ``.bin`` files are never read."""
    out: dict[str, np.ndarray] = {}
    for name in _hf_files(directory):
        out.update(_read_safetensors(os.path.join(directory, name)))
    return out


# the attention's latent / per-head q-k norms, which ``qk_layernorm: false`` leaves out (model names)
_QK_NORM = re.compile(r"\.self_attn\.(q_a_layernorm|kv_a_layernorm|q_a_norm|kv_norm|q_norm|k_norm)\.weight$")


class HFBoxes:
    """An HF model directory read box by box under the model's own parameter names: a rank
    reads only the parts of the files that overlap its pieces (per-expert tensors are stacked
    on the fly, the expert range of the box only). ``names()``, ``global_shapes``, ``read``,
    ``read_full``, ``check_shapes`` and ``check_files`` as the trainer's sharded reader has
    them. The MTP modules' copies of the embedding and head are the main ones; MTP weights the
    directory lacks are left to their initial values (``missing``)."""

    def __init__(self, directory: str, cfg, param_shapes: dict[str, tuple[int, ...]],
                 tensors: Optional[dict[str, np.ndarray]] = None, allow_missing_mtp: bool = True):
        """``tensors``: HF-named arrays already in memory instead of the directory's files
        (``directory`` then only names their source in messages)."""
        from safetensors import safe_open

        self.folder = directory
        self._arrays = tensors
        where: dict[str, str] = {}
        if tensors is None:
            for fname in _hf_files(directory):
                with safe_open(os.path.join(directory, fname), framework="np") as f:
                    for key in f.keys():
                        where[key] = fname
        else:
            where = {key: "" for key in tensors}
        self._open: dict[str, Any] = {}
        self._sources: dict[str, tuple] = {}  # model name -> ("plain", key) | ("experts", [keys]) | ("half", key, part)
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        per_expert: dict[str, dict[int, str]] = {}
        unexpected = []
        unknown_norms = []  # model names of the attention norms a qk_layernorm: false model lacks
        v4 = cfg.model_type == "deepseek_v4"
        for key in where:
            if key.endswith("weight_scale_inv"):
                raise UserError(f"{directory}: holds FP8 block-quantised weights ({key}); convert them to bf16/fp32 first")
            if v4:  # the released / transformers-written names (mindtrain.models.hf_v4_names)
                name, e = file_to_model(key)
                if e is not None:
                    per_expert.setdefault(name, {})[e] = key
                elif name in param_shapes:
                    self._sources[name] = ("plain", key)
                else:
                    unexpected.append(key)
                    unknown_norms += [name] if _QK_NORM.search(name) else []
                continue
            m = _EXPERT_FILE.match(key)
            if m:
                per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = key
                continue
            m = _EXPERT_V5.match(key)
            if m:
                if m.group(2) == "gate_up_proj":
                    self._sources[f"{m.group(1)}.gate_proj"] = ("half", key, 0)
                    self._sources[f"{m.group(1)}.up_proj"] = ("half", key, 1)
                else:
                    self._sources[f"{m.group(1)}.down_proj"] = ("plain", key)
                continue
            m = _MTP_COPIES.match(key)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue
            if key in param_shapes:
                self._sources[key] = ("plain", key)
            else:
                unexpected.append(key)
                unknown_norms += [key] if _QK_NORM.search(key) else []
        if unknown_norms and not getattr(cfg, "qk_layernorm", True):
            raise UserError(f"{directory}: holds {len(unknown_norms)} attention norm weights (e.g. {unknown_norms[0]}) "
                            "that a model with model.qk_layernorm: false does not have; set model.qk_layernorm: "
                            "true to load them (the checkpoint's model has the norms)")
        for name, keys in per_expert.items():
            lacking = [e for e in range(cfg.n_routed_experts) if e not in keys]
            if lacking:
                raise UserError(f"{directory}: {name.rsplit('.', 1)[0]} lacks experts {lacking[:5]} of "
                                f"{cfg.n_routed_experts}")
            self._sources[name] = ("experts", [keys[e] for e in range(cfg.n_routed_experts)])
        self._where = where
        for name, src in self._sources.items():
            shape = self._shape(src[1] if src[0] != "experts" else src[1][0])
            if src[0] == "experts":
                shape = [len(src[1])] + list(shape)
            elif src[0] == "half":
                shape = [shape[0], shape[1] // 2] + list(shape[2:])
            self.global_shapes[name] = tuple(int(n) for n in shape)
        mtp = tuple(f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers))
        absent = [n for n in param_shapes if n not in self._sources]
        lacking = [n for n in absent if not (allow_missing_mtp and mtp and n.startswith(mtp))]
        if lacking:
            raise UserError(f"{directory}: missing {len(lacking)} weights, e.g. {lacking[0]}; "
                            "does config.json match the weights?")
        self.missing = absent
        if absent:
            log.warning("%s: no weights for the %d MTP parameters; they keep their fresh initialisation",
                        directory, len(absent))
        if unexpected:
            log.warning("%s: ignoring %d unknown tensors, e.g. %s", directory, len(unexpected), unexpected[0])

    def names(self) -> list[str]:
        return list(self._sources)

    def check_shapes(self, shapes) -> None:
        for name, shape in shapes:
            if name in self.global_shapes and tuple(self.global_shapes[name]) != tuple(shape):
                raise UserError(f"{self.folder}: {name} has shape {self.global_shapes[name]}, the model expects "
                                f"{tuple(shape)}")

    def check_files(self) -> None:
        """Every tensor the model takes is floating point."""
        for name, src in self._sources.items():
            key = src[1] if src[0] != "experts" else src[1][0]
            dtype = self._slice(key).get_dtype() if self._arrays is None else np.asarray(self._arrays[key]).dtype.name
            dtype = dtype.upper()
            if name.endswith(".tid2eid"):  # DeepSeek-V4's token -> experts table holds integer ids
                continue
            if not dtype.startswith(("F", "BF")):
                raise UserError(f"checkpoint.load_path: '{key}' in {self.folder} is {dtype.lower()}, but the "
                                "model's parameters are floating point; the checkpoint is damaged or of another model")

    def read(self, name: str, offset, shape) -> np.ndarray:
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        src = self._sources[name]
        if src[0] == "plain":
            out = self._slice(src[1])[box]
        elif src[0] == "half":
            half = self.global_shapes[name][1]
            rows = slice(box[1].start + src[2] * half, box[1].stop + src[2] * half)
            out = self._slice(src[1])[(box[0], rows) + box[2:]]
        else:
            out = np.stack([self._slice(src[1][e])[box[1:]] for e in range(box[0].start, box[0].stop)])
        return np.asarray(out, np.float32).reshape(tuple(shape))

    def read_full(self, name: str) -> np.ndarray:
        shape = self.global_shapes[name]
        return self.read(name, (0,) * len(shape), shape)

    def _shape(self, key: str) -> list:
        return list(np.shape(self._arrays[key])) if self._arrays is not None else self._slice(key).get_shape()

    def _slice(self, key: str):
        if self._arrays is not None:
            return np.asarray(self._arrays[key])
        fname = self._where[key]
        if fname not in self._open:
            from safetensors import safe_open

            self._open[fname] = safe_open(os.path.join(self.folder, fname), framework="np")
        return self._open[fname].get_slice(key)


def _hf_files(directory: str) -> list[str]:
    """The safetensors files of an HF directory: those its index names, else every one."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for name in files:
            if not os.path.exists(os.path.join(directory, name)):
                raise UserError(f"{index}: names {name}, which does not exist")
        return files
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"{directory}: no model.safetensors, model.safetensors.index.json or other .safetensors "
                        "weights (only safetensors are read, never pickle .bin files)")
    return files


def read_hf_config(directory: str, **overrides: Any):
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise UserError(f"{path}: not found; from_pretrained needs an HF model directory")
    with open(path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(path, f"is not valid JSON ({err})") from None
    mtp = _v4_mtp_in_files(directory, hf) if "num_nextn_predict_layers" not in overrides else 0
    if mtp:  # DeepSeek-V4: config_from_hf reads HF's count as 0 (HF builds none), the files hold them
        overrides = {**overrides, "num_nextn_predict_layers": mtp}
    cfg = config_from_hf(hf, **overrides)
    validate_model(cfg, path)
    return cfg


def _v4_mtp_in_files(directory: str, hf: dict) -> int:
    """DeepSeek-V4: how many of config.json's ``num_nextn_predict_layers`` MTP modules the
    directory's files hold (``layers.{L+k}.`` tensors, as mindtrain-export-hf and
    save_pretrained write them); 0 for another family or a directory without them (the
    released HF configs name MTP modules their files need not hold)."""
    if hf.get("model_type") != "deepseek_v4" or not int(hf.get("num_nextn_predict_layers") or 0):
        return 0
    from safetensors import safe_open

    keys = set()
    for fname in _hf_files(directory):
        with safe_open(os.path.join(directory, fname), framework="np") as f:
            keys.update(k[len("model."):] if k.startswith("model.") else k for k in f.keys())
    n, k = int(hf["num_hidden_layers"]), 0
    while k < int(hf["num_nextn_predict_layers"]) and any(key.startswith(f"layers.{n + k}.") for key in keys):
        k += 1
    return k


def from_pretrained(directory: str, jit: Optional[bool] = None, compute_dtype: Optional[str] = None,
                    **overrides: Any):
    """Build the model of an HF directory and load its weights. ``overrides`` replace
    ModelConfig fields (e.g. ``seq_length=4096``, ``num_nextn_predict_layers=0``);
    ``jit`` and ``compute_dtype`` as in :func:`mindtrain.models.build_model`."""
    cfg = read_hf_config(directory, **overrides)
    model = build_model(cfg, jit=jit, compute_dtype=compute_dtype)
    load_hf_state_dict(model, read_hf_weights(directory), source=directory)
    return model


def save_pretrained(model, directory: str, max_shard_bytes: int = 2 * 1024 ** 3) -> None:
    """Write config.json and safetensors (sharded with an index above ``max_shard_bytes``)
    that transformers' DeepseekV3ForCausalLM loads."""
    from safetensors.numpy import save_file

    refuse_without_hf_equivalent(model.config)
    tensors = {k: np.ascontiguousarray(v) for k, v in hf_state_dict(model).items()}

    def write(path: str, names: list[str]) -> None:
        # safetensors refuses tensors that share memory; the MTP copies alias the main weights
        save_file({k: tensors[k].copy() for k in names}, path, metadata={"format": "pt"})

    write_hf_directory(directory, config_to_hf(model.config), {k: v.nbytes for k, v in tensors.items()}, write,
                       max_shard_bytes)


def write_hf_directory(directory: str, hf_config: dict, sizes: dict[str, int],
                       write: Callable[[str, list[str]], None], max_shard_bytes: int = 2 * 1024 ** 3) -> list[str]:
    """An HF model directory: config.json, then the tensors ``sizes`` names (name -> bytes)
    in name order, grouped into files of at most ``max_shard_bytes``, each file written by
    ``write(path, names)``, and the index when there is more than one file. Returns the
    safetensors files' names."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if groups[-1] and size + sizes[name] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += sizes[name]
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for fname, names in zip(files, groups):
        write(os.path.join(directory, fname), names)
    if len(groups) > 1:
        weight_map = {n: fname for fname, names in zip(files, groups) for n in names}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
    return files
