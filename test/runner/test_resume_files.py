"""The resumable state's files (pipeline/resume.py): a unit's file holds the tensors that are new since the rank's
earlier kept files and refers to those for the rest. Reference: the tensors as they were saved, compared exactly."""

from __future__ import annotations

import pytest
import torch

from msmodelslim.errors import UserError
from msmodelslim.pipeline.resume import KEEP, ResumeState, StoredTensor


def _keep(state: ResumeState, unit: int, states: list) -> None:
    state.save(0, unit, {"states": states, "savers": [], "processors": [], "report": None}, shards={})


def _raw(state: ResumeState, unit: int) -> dict:
    return torch.load(state.root / "rank0" / f"unit{unit:05d}.pt", weights_only=False)


def test_a_unit_refers_to_the_tensors_it_passed_through_and_writes_its_new_ones(tmp_path):
    """A state with a new hidden state and token ids / blocks passed through: the second file holds the new hidden
    state and references for the rest; loading it gives back every tensor with its values."""
    state = ResumeState(tmp_path)
    ids, block = torch.arange(6).view(1, 6), torch.randn(1, 6, 4)
    _keep(state, 0, [{"hidden_states": torch.randn(1, 6, 4), "input_ids": ids, "blocks": [block]}])
    hidden = torch.randn(1, 6, 4)
    _keep(state, 1, [{"hidden_states": hidden, "input_ids": ids, "blocks": [block, hidden]}])
    raw = _raw(state, 1)["states"][0]
    assert raw["input_ids"] == StoredTensor(0, 0, ("input_ids",))
    assert raw["blocks"][0] == StoredTensor(0, 0, ("blocks", 0))
    assert isinstance(raw["hidden_states"], torch.Tensor) and isinstance(raw["blocks"][1], torch.Tensor)
    loaded = ResumeState(tmp_path).load(0, 1)["states"][0]
    assert torch.equal(loaded["input_ids"], ids) and torch.equal(loaded["blocks"][0], block)
    assert torch.equal(loaded["hidden_states"], hidden) and torch.equal(loaded["blocks"][1], hidden)


def test_a_tensor_changed_in_place_since_it_was_kept_is_written_again(tmp_path):
    state = ResumeState(tmp_path)
    ids = torch.arange(6)
    _keep(state, 0, [{"input_ids": ids}])
    ids.add_(1)  # a new version of the same object
    _keep(state, 1, [{"input_ids": ids}])
    assert isinstance(_raw(state, 1)["states"][0]["input_ids"], torch.Tensor)
    assert torch.equal(ResumeState(tmp_path).load(0, 1)["states"][0]["input_ids"], torch.arange(1, 7))


def test_a_file_a_kept_unit_refers_to_outlives_the_last_units_and_the_others_go(tmp_path):
    """Token ids kept at unit 0 and passed through to unit 5: unit 0's file stays (the last KEEP units refer to it),
    units 1 and 2 go, and a resume after unit 5 reads the ids from unit 0's file."""
    state = ResumeState(tmp_path)
    ids = torch.arange(6)
    for unit in range(6):
        _keep(state, unit, [{"hidden_states": torch.full((6,), float(unit)), "input_ids": ids}])
    assert state.finished(0) == [0, 3, 4, 5] and state.latest(0) == [3, 4, 5] and KEEP == 3
    after = ResumeState(tmp_path)
    after.verify(5, world_size=1)
    loaded = after.load(0, 5)["states"][0]
    assert torch.equal(loaded["input_ids"], ids) and torch.equal(loaded["hidden_states"], torch.full((6,), 5.0))


def test_a_resumed_run_refers_to_the_files_it_restored_from(tmp_path):
    """After a load, the next unit's file refers to the restored tensors where they are kept (unit 0), not anew."""
    ids = torch.arange(6)
    first = ResumeState(tmp_path)
    _keep(first, 0, [{"input_ids": ids}])
    _keep(first, 1, [{"input_ids": ids}])
    assert _raw(first, 1)["states"][0]["input_ids"] == StoredTensor(0, 0, ("input_ids",))
    resumed = ResumeState(tmp_path)
    restored = resumed.load(0, 1)["states"]
    _keep(resumed, 2, restored)
    assert _raw(resumed, 2)["states"][0]["input_ids"] == StoredTensor(0, 0, ("input_ids",))


def test_a_damaged_file_that_a_kept_unit_refers_to_refuses_the_resume(tmp_path):
    state = ResumeState(tmp_path)
    ids = torch.arange(6)
    _keep(state, 0, [{"input_ids": ids}])
    _keep(state, 1, [{"input_ids": ids, "hidden_states": torch.zeros(3)}])
    path = state.root / "rank0" / "unit00000.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="unit00000.pt: its checksum differs"):
        ResumeState(tmp_path).verify(1, world_size=1)


def test_the_checksum_recorded_with_a_unit_is_that_of_its_file_as_read_back(tmp_path):
    """The unit file's checksum is taken as it is written (files.ChecksumWriter); reference: `file_checksum`, which
    reads the finished file back (zlib's CRC-32), equal as text. The file loads memory-mapped with its tensors
    exact."""
    import json

    from msmodelslim.core.files import file_checksum

    state = ResumeState(tmp_path)
    hidden = [torch.randn(3, 1000, 64).to(torch.bfloat16), torch.randn(2, 7)]
    _keep(state, 0, [{"hidden_states": hidden[0], "input_ids": torch.arange(3000).view(3, 1000)},
                     {"hidden_states": hidden[1]}])
    path = state.root / "rank0" / "unit00000.pt"
    assert json.loads(path.with_suffix(".json").read_text())["checksum"] == file_checksum(path)
    loaded = torch.load(path, mmap=True, weights_only=False)["states"]
    assert torch.equal(loaded[0]["hidden_states"], hidden[0]) and torch.equal(loaded[1]["hidden_states"], hidden[1])


def test_a_shards_checksum_from_memory_is_that_of_the_file_as_read_back(tmp_path):
    """The saver's shards are checksummed from the tensors in memory and the file's header (files.
    safetensors_checksum), not read back; reference: `file_checksum` of the written file, equal as text, for
    tensors of every element size the saver writes (bf16, int8 packed int4, float32 scales, a 0-d and an empty one)
    in an order the file does not keep (safetensors sorts them)."""
    from safetensors.torch import save_file

    from msmodelslim.core.files import file_checksum, safetensors_checksum

    g = torch.Generator().manual_seed(0)
    tensors = {"z.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
               "a.weight": torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8),
               "m.weight_scale": torch.rand(48, 1, generator=g), "b.scalar": torch.tensor(3.5),
               "c.empty": torch.zeros(0, 4)}
    path = tmp_path / "shard.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert safetensors_checksum(path, tensors) == file_checksum(path)
