"""The samples' state past the host budget (pipeline/spill.py): files read back memory-mapped, written incrementally.

Reference throughout: the in-memory state the runner would have kept, compared exactly (torch.equal)."""

from __future__ import annotations

import json

import pytest
import torch

from msmodelslim.errors import UserError
from msmodelslim.pipeline.spill import Spilled, SpillRef, StateSpill

HIDDEN = 256


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(1, 64, HIDDEN, generator=g).to(torch.bfloat16),
            "attn_res_blocks": [torch.randn(1, 64, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(3)],
            "input_ids": torch.arange(64).view(1, 64)}


def next_unit(inputs: dict, seed: int) -> dict:
    """What a decoder unit returns: a new hidden state, everything else passed through as the same tensors."""
    return {**inputs, "hidden_states": torch.randn(1, 64, HIDDEN, generator=torch.Generator().manual_seed(seed))
            .to(torch.bfloat16)}


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert torch.equal(a["hidden_states"], b["hidden_states"]) and torch.equal(a["input_ids"], b["input_ids"])
    assert all(torch.equal(x, y) for x, y in zip(a["attn_res_blocks"], b["attn_res_blocks"], strict=True))


@pytest.fixture
def spill(tmp_path) -> StateSpill:
    return StateSpill(tmp_path / "spill", budget=0)


def test_a_state_within_the_budget_stays_in_memory(tmp_path):
    first = state(0)
    assert StateSpill(tmp_path / "spill", budget=1 << 30).keep(1, 0, first, kept_bytes=1 << 20) is first
    assert not (tmp_path / "spill").exists()


def test_a_spilled_state_reads_back_equal(spill):
    first = state(0)
    kept = spill.keep(1, 0, first, kept_bytes=1)
    assert isinstance(kept, Spilled) and kept.refers == ()
    assert_equal_states(spill.load(kept), first)


def test_a_unit_spills_only_the_tensors_it_made_and_refers_to_the_ones_it_passed_through(spill):
    # the next unit's file holds its new hidden state (64 x 256 bf16 = 32 KiB), not the blocks and ids it passed
    # through (96 KiB + 0.5 KiB): they are SpillRefs to the first file; read back, the state is the one it returned
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    second_state = next_unit(spill.load(first), seed=1)
    second = spill.keep(2, 0, second_state, kept_bytes=1)
    assert second.refers == ((first.path, first.bytes),)
    assert second.bytes < 64 * HIDDEN * 2 + 8 * 1024 < first.bytes
    stored = torch.load(second.path, weights_only=False)
    assert all(isinstance(b, SpillRef) and b.path == first.path for b in stored["attn_res_blocks"])
    assert_equal_states(spill.load(second), second_state)
    assert json.loads((spill.unit_folder(2) / "refers.json").read_text()) == [spill.unit_folder(1).name]


def test_references_name_the_file_that_holds_the_bytes_not_a_chain(spill):
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    second = spill.keep(2, 0, next_unit(spill.load(first), seed=1), kept_bytes=1)
    third = spill.keep(3, 0, next_unit(spill.load(second), seed=2), kept_bytes=1)
    assert third.refers == ((first.path, first.bytes),)


def test_a_tensor_changed_in_place_is_written_again(spill):
    # the same tensor object at a new version is not what the earlier file holds
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    passed = next_unit(spill.load(first), seed=1)
    passed["attn_res_blocks"][1].add_(1)  # a mmap-backed tensor: copy-on-write, the file keeps its bytes
    second = spill.keep(2, 0, passed, kept_bytes=1)
    stored = torch.load(second.path, weights_only=False)
    assert [isinstance(b, SpillRef) for b in stored["attn_res_blocks"]] == [True, False, True]
    assert_equal_states(spill.load(second), passed)


def test_small_tensors_do_not_keep_a_large_file_alive(spill):
    # the token ids passed on from the vision unit, whose file is mostly pixels: referring to them would keep the
    # pixels (2.4 MB) on disk for the whole run, so they are written again
    ids = torch.arange(64).view(1, 64)
    first = spill.keep(0, 0, {"input_ids": ids, "pixel_values": torch.randn(256, 3, 28, 28)}, kept_bytes=1)
    second = spill.keep(1, 0, {"input_ids": spill.load(first)["input_ids"], "hidden_states": torch.zeros(1, 64, 8)},
                        kept_bytes=1)
    assert second.refers == ()
    assert torch.equal(spill.load(second)["input_ids"], ids)


def test_dropping_old_units_keeps_the_folders_a_live_unit_refers_to(spill):
    # after unit 3, the inputs of unit 2 (its folder) go; unit 1's folder stays: units 2 and 3 read its blocks
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    second = spill.keep(2, 0, next_unit(spill.load(first), seed=1), kept_bytes=1)
    third = spill.keep(3, 0, next_unit(spill.load(second), seed=2), kept_bytes=1)
    spill.drop_before(3)
    assert sorted(p.name for p in spill.folder.iterdir()) == ["unit00001", "unit00003"]
    assert third.missing() is None and second.missing() == second.path
    assert spill.load(third)["attn_res_blocks"][0].shape == (1, 64, HIDDEN)


def test_a_kept_unit_and_what_it_refers_to_survive_the_drop(spill):
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    second = spill.keep(2, 0, next_unit(spill.load(first), seed=1), kept_bytes=1)
    spill.keep(3, 0, state(5), kept_bytes=1)  # a unit that passes nothing through
    spill.drop_before(3, keep={2})
    assert sorted(p.name for p in spill.folder.iterdir()) == ["unit00001", "unit00002", "unit00003"]
    spill.drop_before(3)  # unit 2 no longer kept
    assert sorted(p.name for p in spill.folder.iterdir()) == ["unit00003"]
    assert second.missing() == second.path


def test_a_damaged_spill_file_is_one_line(spill):
    first = spill.keep(1, 0, state(0), kept_bytes=1)
    with open(first.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=r"a spilled calibration state is unreadable .*--fresh"):
        spill.load(first)


def test_a_state_saved_without_the_archive_crc_reads_back_equal_and_the_switch_is_restored(tmp_path):
    # torch.save's per-record CRC-32 is never checked on load; the resumable state checksums its files itself.
    # Reference: the zip directory (Python's zipfile) holds CRC 0 for every record
    import zipfile

    from torch.utils.serialization import config

    from msmodelslim.pipeline.spill import save_without_crc

    before = config.save.compute_crc32
    first = state(0)
    save_without_crc(first, tmp_path / "s.pt")
    assert config.save.compute_crc32 == before
    assert all(record.CRC == 0 for record in zipfile.ZipFile(tmp_path / "s.pt").infolist())
    assert_equal_states(torch.load(tmp_path / "s.pt", weights_only=False), first)
