"""Refactors keep the bytes: every file of the outputs the consumer tests are handed (both models, their shipped
practices with test/consumer/outputs.py's plain numerics) has the SHA-256 recorded in test/app/output_hashes.json
at cbf2374, before issue 26's rework. Exact. bench/output_hashes.py checks every shipped practice of both models,
with the practices' own numerics too, and re-records after an intended change (`--record`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .outputs import file_hashes

pytestmark = pytest.mark.slow  # the outputs are whole quantization runs

RECORD = Path(__file__).resolve().parents[1] / "app" / "output_hashes.json"


def test_outputs_are_byte_identical_to_the_recorded_ones(outputs):
    recorded = json.loads(RECORD.read_text())["plain"]
    for (model, quant_type), out in sorted(outputs.items()):
        assert file_hashes(out) == recorded[f"{model}_{quant_type}"], f"{model} {quant_type}"
