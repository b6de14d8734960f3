"""SHA-256 of every file of our outputs, for every shipped practice of both models: the record a refactor is held to
(test/app/test_output_identity.py compares the outputs the suite builds with it; issue 26).

Two sets, each on the tiny Kimi-K3 (seed 0) and on kimi-linear-mini:
- `plain`: test/consumer/outputs.py's outputs (2 samples of <= 64 tokens, min/max weights, fixed-alpha smoothing),
  the ones the suite builds once per session and hashes;
- `shipped`: the same calibration cut with the practices' own numerics (GPTQ, the smoothing search), compared here.

    python bench/output_hashes.py --record     # write test/app/output_hashes.json
    python bench/output_hashes.py              # compare with it; the JSON line counts the differing files

The record holds the CPU capability torch's kernels ran with (`torch.backends.cpu.get_cpu_capability()`): float
kernels of another instruction set round activations differently, and the calibration statistics with them, so the
bytes are comparable on CPUs of that capability only. The quant report is left out (`file_hashes`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import ROOT, generated_checkpoint, machine, print_result  # noqa: E402

sys.path.insert(0, str(ROOT / "test"))
from consumer.outputs import build_outputs, file_hashes  # noqa: E402

RECORD = ROOT / "test" / "app" / "output_hashes.json"


def output_hashes(root: Path, tiny_k3: Path, plain_numerics: bool) -> dict[str, dict[str, str]]:
    root.mkdir(parents=True)
    outputs = build_outputs(root, tiny_k3, every_practice=True, plain_numerics=plain_numerics)
    return {f"{model}_{quant_type}": file_hashes(out) for (model, quant_type), out in sorted(outputs.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(ROOT)}")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-hashes-") as root:
        tiny = generated_checkpoint("tiny")
        found = {"plain": output_hashes(Path(root) / "plain", tiny, plain_numerics=True),
                 "shipped": output_hashes(Path(root) / "shipped", tiny, plain_numerics=False)}
    capability = torch.backends.cpu.get_cpu_capability()
    if args.record:
        RECORD.write_text(json.dumps({**found, "cpu_capability": capability}, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(RECORD.read_text())
    if recorded.get("cpu_capability") != capability:
        print(f"the record was made on {recorded.get('cpu_capability')} CPUs, this one is {capability}: bytes "
              f"may differ for that alone", flush=True)
    recorded.pop("cpu_capability", None)
    differing = sorted(f"{kind}/{output}/{name}" for kind, outputs in found.items()
                       for output, files in outputs.items() for name, digest in files.items()
                       if recorded.get(kind, {}).get(output, {}).get(name) != digest)
    missing = sorted(f"{kind}/{output}" for kind, outputs in recorded.items() for output in outputs
                     if output not in found.get(kind, {}))
    for name in differing + missing:
        print(f"differs: {name}", flush=True)
    print_result({"bench": "output_hashes", "machine": machine(), "recorded": args.record,
                  "outputs": sum(len(o) for o in found.values()),
                  "files": sum(len(f) for o in found.values() for f in o.values()),
                  "differing_files": len(differing), "missing_outputs": len(missing),
                  "seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
