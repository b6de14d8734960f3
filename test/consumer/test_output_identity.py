"""Refactors keep the bytes: every file of the outputs the consumer tests are handed (both models, their shipped
practices with test/consumer/outputs.py's plain numerics) has the SHA-256 recorded in test/app/output_hashes.json
before issue 26's rework (cbf2374), and again on AVX512 CPUs at fff0008, before issue 33 (the first record's CPUs
round float kernels differently: its layer shards did not match here), and at issue 34 (only the 28 descriptions
changed: their source identity gained tensors_sha256; then the 8 practice copies of the per-group and
w4a8c8 practices, which gained metadata.serving_note); bench/output_hashes.py's shipped set (GPTQ, the smoothing search) again in session 20, when iter_smooth began carrying GPTQ's Hessians. Exact, on CPUs of the recorded capability; elsewhere the
test is skipped, saying why. bench/output_hashes.py checks every shipped practice of both models, with the
practices' own numerics too, and re-records after an intended change (`--record`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .outputs import file_hashes

pytestmark = pytest.mark.slow  # the outputs are whole quantization runs

RECORD = Path(__file__).resolve().parents[1] / "app" / "output_hashes.json"


def test_outputs_are_byte_identical_to_the_recorded_ones(outputs):
    record = json.loads(RECORD.read_text())
    capability = torch.backends.cpu.get_cpu_capability()
    if record["cpu_capability"] != capability:
        pytest.skip(f"recorded on {record['cpu_capability']} CPUs; this one's float kernels ({capability}) round "
                    f"differently")
    recorded = record["plain"]
    for (model, quant_type), out in sorted(outputs.items()):
        assert file_hashes(out) == recorded[f"{model}_{quant_type}"], f"{model} {quant_type}"
