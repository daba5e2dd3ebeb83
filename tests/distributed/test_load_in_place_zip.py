"""`load_in_place` on every torch the project supports (torch>=2.4): the file's records placed with Python's
`zipfile`, not torch's file reader (whose `get_record_size` only torch 2.10 on has)."""

import torch

from cadence.distributed import load_in_place
from cadence.distributed.load_in_place import file_offsets, load_mapped, load_optimizer_in_place


class ReaderOfTorch29:
    """torch 2.9's `PyTorchFileReader`: no `get_record_size`."""

    def __init__(self, *args):
        self._reader = torch._C.PyTorchFileReader(*args)

    def __getattr__(self, name):
        if name == "get_record_size":
            raise AttributeError(f"'torch._C.PyTorchFileReader' object has no attribute {name!r}")
        return getattr(self._reader, name)


def test_the_files_records_are_placed_without_torchs_record_sizes(tmp_path, monkeypatch):
    """A reader without `get_record_size` (torch 2.4-2.9) changes nothing: each tensor is still placed at its own
    bytes in the file and read from them into the optimizer's."""
    state = {"a": torch.randn(100), "b": torch.arange(7), "empty": torch.zeros(0), "h": torch.ones(3, dtype=torch.half)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    mapped = load_mapped(str(path))
    monkeypatch.setattr(torch._C, "PyTorchFileReader", ReaderOfTorch29)  # torch.load's own use of it done
    offsets = file_offsets(str(path), list(mapped.values()))
    raw = path.read_bytes()
    for name, t in mapped.items():
        size = t.numel() * t.element_size()
        assert raw[offsets[id(t)]:offsets[id(t)] + size] == state[name].view(torch.uint8).numpy().tobytes(), name

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    monkeypatch.undo()
    torch.save(opt.state_dict(), path)
    expected = torch.load(path)
    opt.step()
    live = [id(t) for s in opt.state.values() for t in s.values()]
    reads, read_exactly = [], load_in_place.read_exactly
    monkeypatch.setattr(load_in_place, "read_exactly",
                        lambda f, offset, t: reads.append(offset) or read_exactly(f, offset, t))
    mapped = load_mapped(str(path))
    monkeypatch.setattr(torch._C, "PyTorchFileReader", ReaderOfTorch29)
    load_optimizer_in_place(opt, mapped, str(path))
    assert [id(t) for s in opt.state.values() for t in s.values()] == live
    assert len(reads) == 6  # every state tensor (each parameter's step and two moments) read from the file
    for i, p in enumerate(params):
        assert all(torch.equal(opt.state[p][k], v) for k, v in expected["state"][i].items()), i


def test_the_records_are_where_torchs_reader_says(tmp_path):
    """On every torch: the offsets torch's reader gives, the sizes of the records it reads (and, from torch 2.10 on,
    the sizes it gives)."""
    path = tmp_path / "state.pt"
    torch.save({"a": torch.randn(100), "b": torch.arange(7), "empty": torch.zeros(0)}, path)
    reader = torch._C.PyTorchFileReader(str(path))
    names = [n for n in reader.get_all_records() if n.startswith("data/")]
    expected = {reader.get_record_offset(n): len(reader.get_record(n)) for n in names}
    assert len(expected) == 3 and load_in_place.data_records(str(path)) == expected
    if hasattr(reader, "get_record_size"):   # torch >= 2.10
        assert {reader.get_record_offset(n): reader.get_record_size(n) for n in names} == expected


def test_a_file_that_is_not_a_zip_archive_has_no_records(tmp_path):
    data_records = load_in_place.data_records
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a zip" * 10)
    assert data_records(str(path)) == {}
    assert data_records(str(tmp_path / "missing.pt")) == {}
