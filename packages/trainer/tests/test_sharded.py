"""Sharded checkpoint files (numpy only): pieces written by several ranks, read back as any
other layout's boxes; incomplete and mismatched checkpoints are one line naming what is wrong."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from mindtrain.config import UserError
from mindtrain.trainer import sharded

RNG = np.random.default_rng(0)
FULL = {"w": RNG.standard_normal((6, 4)).astype(np.float32),  # rows over 3 ranks (2 each), rank 3 a replica
        "e": RNG.standard_normal((4, 3, 2)).astype(np.float32),  # experts over 2, cols over 2
        "b": RNG.standard_normal(5).astype(np.float32),  # whole on every rank
        "step": np.array(7, np.int64)}
# rank -> [(name, offset, shape)]
BOXES = {0: [("w", (0, 0), (2, 4)), ("e", (0, 0, 0), (2, 3, 1)), ("b", (0,), (5,)), ("step", (), ())],
         1: [("w", (2, 0), (2, 4)), ("e", (0, 0, 1), (2, 3, 1)), ("b", (0,), (5,)), ("step", (), ())],
         2: [("w", (4, 0), (2, 4)), ("e", (2, 0, 0), (2, 3, 1)), ("b", (0,), (5,)), ("step", (), ())],
         3: [("w", (4, 0), (2, 4)), ("e", (2, 0, 1), (2, 3, 1)), ("b", (0,), (5,)), ("step", (), ())]}


def _box(a, offset, shape):
    return a[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _write(folder: str, world: int = 4) -> None:
    """What Checkpointer.save_sharded does on each rank, the exchange done in one process."""
    everyone = [[sharded.Piece("model", n, FULL[n].shape, o, s, FULL[n].dtype.name) for n, o, s in BOXES[r]]
                for r in range(world)]
    writer = sharded.writers(everyone)

    def file_of(p):
        return sharded.file_name(None, p.kind, writer[p.key], world)

    for r, pieces in enumerate(everyone):
        mine = [(p.name, np.array(_box(FULL[p.name], p.offset, p.shape))) for p in pieces
                if writer[p.key] == r]
        if mine:
            sharded.write_safetensors(os.path.join(folder, sharded.file_name(None, "model", r, world)), mine)
    written = [p for r, ps in enumerate(everyone) for p in ps if writer[p.key] == r]
    with open(os.path.join(folder, sharded.METADATA_FILE), "w") as f:
        json.dump(sharded.metadata(written, file_of, world), f)


def test_pieces_read_back_as_any_box(tmp_path):
    _write(str(tmp_path))
    # replicas written once: rank 3's copy of w's last rows and everyone's b and step are rank 0's / 2's
    assert sorted(load_file(str(tmp_path / "model-0000003-0000004.safetensors"))) == ["e"]
    assert sorted(load_file(str(tmp_path / "model-0000000-0000004.safetensors"))) == ["b", "e", "step", "w"]
    meta = json.load(open(tmp_path / "metadata.json"))
    assert meta["state_dict_metadata"]["e"]["axis_fragmentations"] == [2, 1, 2]
    assert meta["storage_data"]["('w', (4, 0))"][0]["file_name"] == "model-0000002-0000004.safetensors"
    reader = sharded.ShardedReader(str(tmp_path))
    reader.check_files()
    for name, a in FULL.items():
        np.testing.assert_array_equal(reader.read_full(name), a)
    # boxes that cut across the written pieces: another layout's
    for name, offset, shape in (("w", (1, 1), (4, 2)), ("e", (1, 1, 0), (2, 2, 2)), ("w", (5, 0), (1, 4))):
        np.testing.assert_array_equal(reader.read(name, offset, shape), _box(FULL[name], offset, shape))


def test_incomplete_or_foreign_checkpoints_name_what_is_wrong(tmp_path):
    _write(str(tmp_path))
    reader = sharded.ShardedReader(str(tmp_path))
    with pytest.raises(UserError, match=r"'w' has shape \[6, 4\] in .*, the model's is \[6, 5\]; .*another model"):
        reader.check_shapes([("b", (5,)), ("w", (6, 5))])
    with pytest.raises(UserError, match="holds no 'x'"):
        reader.check_shapes([("x", (1,))])
    missing = tmp_path / "model-0000002-0000004.safetensors"
    os.remove(missing)
    with pytest.raises(UserError) as err:
        reader.read("w", (3, 0), (2, 4))  # rows 4.. are in rank 2's file
    assert "'w'" in str(err.value) and str(missing) in str(err.value) and "\n" not in str(err.value)
    # a chunk left out of metadata.json: the box it covered is not covered
    other = tmp_path / "other"
    other.mkdir()
    _write(str(other))
    meta = json.load(open(other / "metadata.json"))
    meta["state_dict_metadata"]["e"]["chunk"] = meta["state_dict_metadata"]["e"]["chunk"][:3]
    json.dump(meta, open(other / "metadata.json", "w"))
    with pytest.raises(UserError, match=r"the chunks of 'e' in .* cover 18 of the 24 elements.*incomplete"):
        sharded.ShardedReader(str(other)).read_full("e")


def test_files_are_plain_safetensors_and_bf16_reads_as_float32(tmp_path):
    a = RNG.standard_normal((3, 2)).astype(np.float32)
    path = str(tmp_path / "x.safetensors")
    sharded.write_safetensors(path, [("a", a), ("s", np.array(3, np.int64))], metadata={"format": "pt"})
    back = load_file(path)
    np.testing.assert_array_equal(back["a"], a)
    assert back["s"].shape == () and int(back["s"]) == 3
    # a BF16 chunk (MindFormers' usual params_dtype) written by hand: the top 16 bits of float32
    bf16 = (a.view(np.uint32) >> 16).astype(np.uint16)
    header = json.dumps({"a": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, bf16.nbytes]}}).encode()
    with open(tmp_path / "model-0000000-0000001.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bf16.tobytes())
    piece = sharded.Piece("model", "a", (3, 2), (0, 0), (3, 2), "float32")
    meta = sharded.metadata([piece], lambda p: "model-0000000-0000001.safetensors", 1)
    json.dump(meta, open(tmp_path / "metadata.json", "w"))
    got = sharded.ShardedReader(str(tmp_path)).read("a", (1, 0), (2, 2))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a[1:], rtol=1e-2)
