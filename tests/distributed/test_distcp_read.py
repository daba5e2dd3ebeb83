"""DirectReader: torch's distributed checkpoint read straight into the tensors it restores (one process, no group).

Checked against torch's own FileSystemReader on the same files: the same values land, the tensors it can read
directly are read directly, the rest (a transposed saved tensor, non-tensor items) still load through torch's path
(a part of a saved tensor, on another world size: tests/distributed/test_engines.py's resume of 2 processes on 4), and a truncated or missing shard file is refused before anything is read (FSDP checks before it loads).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from cadence.distributed import distcp_read
from cadence.distributed.distcp_read import DirectReader


def saved_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "half": torch.randn(16, generator=g).to(torch.bfloat16),
            "ids": torch.arange(10, dtype=torch.int64), "step": torch.tensor(7.0), "flag": torch.tensor([True, False]),
            "transposed": torch.randn(8, 4, generator=g).t(), "lr": 0.25, "name": "adam"}


def empty_like(state: dict) -> dict:
    return {k: torch.zeros_like(v).contiguous() if torch.is_tensor(v) else None for k, v in state.items()}


@pytest.fixture
def checkpoint(tmp_path):
    dcp.save(saved_state(), checkpoint_id=tmp_path / "sharded", no_dist=True)
    return tmp_path / "sharded"


def test_loads_what_torchs_reader_loads_reading_whole_tensors_straight_in(checkpoint, monkeypatch):
    direct = []
    real = distcp_read._read_into
    monkeypatch.setattr(distcp_read, "_read_into", lambda *a: direct.append(real(*a)) or direct[-1])
    ours, torchs = empty_like(saved_state()), empty_like(saved_state())
    dcp.load(ours, storage_reader=DirectReader(checkpoint), no_dist=True)
    dcp.load(torchs, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    for key, value in saved_state().items():
        if torch.is_tensor(value):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
            assert torch.equal(ours[key], torchs[key]), key
        else:
            assert ours[key] == torchs[key] == value, key
    # w, half, ids, step, flag read in place; the transposed one (its saved layout is not the target's) through torch
    assert direct.count(True) == 5 and direct.count(False) == 1, direct


def test_a_truncated_or_missing_shard_file_is_refused_before_reading(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"{shard.name} is truncated \({len(data) - 100} bytes\): its .metadata places "
                                         rf"{len(data)} bytes there; the checkpoint is damaged, resume from another"):
        DirectReader(checkpoint).check()
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard.name} is missing"):
        DirectReader(checkpoint).check()


def test_a_record_it_cannot_parse_is_left_to_torchs_reader(tmp_path):
    """`_read_into` parses a saved tensor's zip record itself; a record that is not what torch writes (a damaged
    central directory, an entry count or a name beyond it, a local header whose name length is off, which would
    shift the bytes read) writes nothing into the target and says so, raising nothing."""
    import io

    buffer = io.BytesIO()
    torch.save(torch.arange(12.0), buffer)
    record = buffer.getvalue()
    directory = record.rfind(b"PK\x01\x02")  # the last entry of the central directory
    end = record.rfind(b"PK\x05\x06")
    damaged = {"signature": record[:directory] + b"XX" + record[directory + 2:],
               "count": record[:end + 8] + (500).to_bytes(2, "little") * 2 + record[end + 12:],
               "name length": record[:directory + 28] + (60000).to_bytes(2, "little") + record[directory + 30:]}
    data = record.find(b"PK\x03\x04", record.find(b"archive/byteorder"))  # the tensor's bytes' local header
    damaged["local name length"] = record[:data + 26] + (17).to_bytes(2, "little") + record[data + 28:]
    for what, data in {"whole": record, **damaged}.items():
        path = tmp_path / what
        path.write_bytes(data)
        target = torch.zeros(12)
        with open(path, "rb") as f:
            read = distcp_read._read_into(f, 0, len(data), target)
        assert read == (what == "whole") and torch.equal(target, torch.arange(12.0) if read else torch.zeros(12)), what
