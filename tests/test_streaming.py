"""Checkpoint files written from device memory through two page-locked buffers (cadence/streaming.py).

A GPU is the reason for this code and CI has none: the buffers' pipeline runs here on CPU memory, driven through
`staged=` in place of a GPU's (the same code but the page-locked allocation and the CUDA event), and the last test,
skipped without CUDA, runs it on GPU memory. Every file is compared byte for byte with what torch.save or
safetensors writes of the same state.
"""

import argparse
import collections
import dataclasses
import enum
import functools
import io

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cadence import streaming
from cadence.serialization import load_torch, save_torch, write_safetensors
from cadence.streaming import save_torch_streaming


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def streamed(obj, path) -> bytes:
    with open(path, "wb") as f:
        save_torch_streaming(obj, f)
    return path.read_bytes()


def optimizer_like_state():
    """What an optimizer file holds: per-parameter tensors of several dtypes, a scalar step, an empty tensor, one
    storage seen through two views and the whole of it, a transposed (non-contiguous) view, and a tensor over the
    size whose checksum is summed in a thread of its own while it is written."""
    torch.manual_seed(0)
    flat = torch.randn(300, 50)
    return {"state": {0: {"exp_avg": torch.randn(1000, 37), "step": torch.tensor(3.0), "part": flat[10:20],
                          "flat": flat, "bf16": torch.randn(777).to(torch.bfloat16)},
                      1: {"empty": torch.empty(0), "mask": torch.rand(9) > 0.5, "count": torch.arange(11),
                          "large": torch.randn(600_000)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}], "transposed": flat.t()}


def counting_pieces(monkeypatch, **options) -> list[int]:
    """`host_pieces` with `options`, counting the bytes it gives: none when the file was torch.save's own."""
    given, host_pieces = [], streaming.host_pieces

    def pieces(tensors):
        for piece in host_pieces(tensors, **options):
            given.append(piece.nbytes)
            yield piece
    monkeypatch.setattr(streaming, "host_pieces", pieces)
    return given


@pytest.mark.parametrize("options", [{}, {"chunk_bytes": 4096, "staged": lambda t: True}],
                         ids=["own memory", "through the buffers"])
def test_a_streamed_torch_save_is_torch_saves_file_byte_for_byte(tmp_path, monkeypatch, options):
    """Records filled in after the layout, their checksums and torch's serialization id: the very file torch.save
    writes, which loads with storages shared as they were."""
    given = counting_pieces(monkeypatch, **options)
    state = optimizer_like_state()
    assert streamed(state, tmp_path / "optimizer.pt") == torch_saved(state)
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in streaming_tensors(state)}
    assert sum(given) == sum(storages.values())  # every byte streamed, none left to torch.save
    assert len(given) == (len([n for n in storages.values() if n]) if not options else
                          sum(-(-n // 4096) for n in storages.values()))
    loaded = load_torch(tmp_path / "optimizer.pt")
    assert torch.equal(loaded["state"][0]["part"], state["state"][0]["part"])
    assert loaded["state"][0]["part"].untyped_storage().data_ptr() == loaded["state"][0]["flat"].untyped_storage().data_ptr()
    assert torch.equal(loaded["transposed"], state["transposed"])


class Stage(enum.Enum):
    ONE = 1


@dataclasses.dataclass
class Scaler:
    scale: float
    history: list


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Keyed(dict):
    pass


def test_objects_beside_the_tensors_are_streamed_as_torch_save_writes_them(tmp_path, monkeypatch):
    """What DeepSpeed's files hold beside tensors (its config, loss scaler, enums): the pickle's storage references
    are counted by walking it with stand-ins for every class, whatever the objects, and the file is streamed."""
    given = counting_pieces(monkeypatch)
    w = torch.randn(1000)
    state = {"ordered": collections.OrderedDict(w=w), "default": collections.defaultdict(list, a=[w[:10]]),
             "scaler": Scaler(2.0**16, [1, 2]), "stage": Stage.ONE, "args": argparse.Namespace(lr=0.1, t=w),
             "sets": ({1, 2}, frozenset({3})), "slotted": Slotted(w[5:]), "keyed": Keyed(x=torch.ones(3)),
             "bytes": b"\x00\x01", "none": None}
    assert streamed(state, tmp_path / "state.pt") == torch_saved(state)
    assert sum(given) == w.nbytes + 12  # w's storage once, and the ones


def test_save_torch_streams_a_large_cpu_state_and_leaves_a_small_one_to_torch_save(tmp_path, monkeypatch):
    """A small state on the CPU is torch.save's own writing (streaming's second pass costs more than it saves
    there); from 16 MiB of tensors it is streamed, each checksum summed while the tensor is written: the same
    bytes either way, and a file that Python's zipfile finds sound (every record's CRC-32 checked)."""
    import zipfile

    given = counting_pieces(monkeypatch)
    small = optimizer_like_state()
    save_torch(small, tmp_path / "small.pt")
    assert (tmp_path / "small.pt").read_bytes() == torch_saved(small)
    assert not given, "a state under 16 MiB was streamed"
    large = {"state": {i: {"exp_avg": torch.randn(1 << 20), "step": torch.tensor(float(i))} for i in range(5)},
             "param_groups": [{"lr": 0.1, "params": list(range(5))}]}   # 20 MiB of moments
    save_torch(large, tmp_path / "large.pt")
    assert sum(given) == 5 * (4 << 20) + 5 * 4, "a state of 20 MiB of CPU tensors was not streamed"
    assert (tmp_path / "large.pt").read_bytes() == torch_saved(large)
    with zipfile.ZipFile(tmp_path / "large.pt") as archive:
        assert archive.testzip() is None


class SavedInside:
    """Pickles its tensor as torch.save's bytes: a save inside the save."""

    def __init__(self, t):
        self.t = t

    def __getstate__(self):
        buffer = io.BytesIO()
        torch.save(self.t, buffer)
        return {"saved": buffer.getvalue()}

    def __setstate__(self, state):
        self.t = torch.load(io.BytesIO(state["saved"]), weights_only=True)


@pytest.mark.parametrize("order", ["inside first", "tensor first"])
def test_an_object_that_saves_inside_the_save_gets_torch_saves_file(tmp_path, monkeypatch, order):
    """The save inside would be laid out too (its bytes left out) and its storages counted with the file's: the
    references the file's pickle holds do not add up, so the file is torch.save's, its tensors whole."""
    given = counting_pieces(monkeypatch)
    a, b = torch.randn(4), torch.randn(4)
    state = {"inside": SavedInside(a), "b": b, "a": a} if order == "inside first" else {"a": a, "inside": SavedInside(a)}
    assert streamed(state, tmp_path / "state.pt") == torch_saved(state)
    loaded = torch.load(tmp_path / "state.pt", weights_only=False)
    assert torch.equal(loaded["inside"].t, a) and torch.equal(loaded["a"], a) and not given


def test_with_torchs_checksums_turned_off_the_file_is_torch_saves(tmp_path, monkeypatch):
    given = counting_pieces(monkeypatch)
    state = optimizer_like_state()
    torch.serialization.set_crc32_options(False)
    try:
        assert streamed(state, tmp_path / "optimizer.pt") == torch_saved(state) and not given
    finally:
        torch.serialization.set_crc32_options(True)


def streaming_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    for value in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ():
        yield from streaming_tensors(value)


def test_a_state_torch_cannot_lay_out_first_is_saved_by_torch_save(tmp_path, monkeypatch):
    """A nested tensor, which torch's `skip_data` refuses: the file is torch.save's all the same."""
    given = counting_pieces(monkeypatch)
    state = {"nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "w": torch.randn(100)}
    assert streamed(state, tmp_path / "state.pt") == torch_saved(state)
    assert not given


def test_what_torch_save_refuses_is_refused_as_torch_save_says(tmp_path):
    """One memory seen as two dtypes: torch.save's own error, raised from the one pickling, not a fallback's second."""
    w, pickled = torch.randn(8), []
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        streamed({"counted": Counted(pickled), "w": w, "bits": w.view(torch.int32)}, tmp_path / "state.pt")
    assert len(pickled) == 1


class Counted:
    def __init__(self, pickled: list):
        self.pickled = pickled

    def __reduce__(self):
        self.pickled.append(1)
        return (int, (0,))


def test_host_pieces_hold_two_buffers_and_give_every_byte_in_order():
    """Device tensors (here CPU ones sent through the buffers) come in pieces of at most the chunk, in two buffers
    taken in turn; a tensor written from its own memory comes whole, after the pieces before it."""
    torch.manual_seed(0)
    tensors = [torch.randn(5000), torch.randn(40, 30).t(), torch.empty(0), torch.arange(7, dtype=torch.int16),
               torch.randn(3000).to(torch.bfloat16)]
    own = tensors[3]
    pieces, starts = [], set()
    for piece in streaming.host_pieces(tensors, chunk_bytes=4096, staged=lambda t: t is not own):
        starts.add(np.frombuffer(piece, dtype=np.uint8).ctypes.data)
        pieces.append(bytes(piece))
    expected = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    assert b"".join(pieces) == expected
    assert max(map(len, pieces)) == 4096
    assert bytes(own.numpy()) in pieces  # whole, from its own memory
    assert len(starts - {own.data_ptr()}) == 2  # each piece at the start of one of the two buffers


def test_safetensors_written_through_the_buffers_are_the_file_written_from_memory(tmp_path, monkeypatch):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3000), "b": torch.randn(30, 20).t(), "c": torch.ones(5, dtype=torch.bool)}
    write_safetensors(tensors, tmp_path / "own.safetensors")
    monkeypatch.setattr("cadence.serialization.host_pieces",
                        functools.partial(streaming.host_pieces, chunk_bytes=4096, staged=lambda t: True))
    write_safetensors(tensors, tmp_path / "buffers.safetensors")
    assert (tmp_path / "buffers.safetensors").read_bytes() == (tmp_path / "own.safetensors").read_bytes()
    loaded = load_file(tmp_path / "buffers.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_files_written_from_gpu_memory_are_those_written_from_its_host_copy(tmp_path):
    """More than two 64 MiB pieces of GPU memory through the page-locked buffers, written while the next copies."""
    state = {k: v.cuda() for k, v in optimizer_like_state()["state"][0].items()}
    state["big"] = torch.randn(3 * streaming.CHUNK_BYTES // 4 + 123, device="cuda")
    host = {k: v.cpu() for k, v in state.items()}
    save_torch(state, tmp_path / "gpu.pt")
    save_torch(host, tmp_path / "host.pt")
    assert (tmp_path / "gpu.pt").read_bytes() == (tmp_path / "host.pt").read_bytes()
    tensors = {k: v for k, v in state.items() if v.is_contiguous() and k != "part"}
    write_safetensors(tensors, tmp_path / "gpu.safetensors")
    write_safetensors({k: host[k] for k in tensors}, tmp_path / "host.safetensors")
    assert (tmp_path / "gpu.safetensors").read_bytes() == (tmp_path / "host.safetensors").read_bytes()
