"""Memory the Hessians' pending rows hold during a calibration pass, against the calibration tokens.

A Hessian sums its rows in chunks of 2^10 (pipeline/statistics.py), so a routed expert holds the rows it got until a
chunk fills, across micro-batches when it is rarely routed. Its rows arrive as a slice of all the micro-batch's
routed tokens (quant/modules.linears_over_row_groups): held as that slice, they kept the whole buffer alive, one per
micro-batch, and the device peak of one full-size Kimi-K3 layer grew with the tokens (H100, session 25: 25.7 GiB at
16k-256k tokens, 47.7 GiB at 1M). This bench runs the K3 layer's structure per EP-8 rank (bench/launches.py's shrunk
`layer` preset: 112 experts, top-2) with the shipped `kimi_k3_w4a8` on generated long records, in this process, and
reports per size the most storage bytes the pending rows kept alive at once (every storage counted once). Bounded:
at most the rows of one chunk per Hessian, whatever the tokens.

    python bench/hessian_pins.py [--tokens 16384,65536]
Run it from an older tree's copy (e.g. `git archive` of 5589c46~2 with this file copied in) for the before side.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import BENCH_OUT, ROOT, machine, print_result, shrunken_practice  # noqa: E402
from bench.k3_layer import long_record_set  # noqa: E402
from bench.launches import shrunk_layer_checkpoint  # noqa: E402
from msmodelslim.cli.main import main as cli  # noqa: E402
from msmodelslim.pipeline import statistics  # noqa: E402


def pinned_peak(model: Path, tokens: int, seq_len: int = 1024) -> int:
    """The most bytes of storage the Hessians' pending rows held at once over a whole quant run."""
    folder, records = long_record_set(tokens, seq_len)
    practice = shrunken_practice(ROOT / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml",
                                 BENCH_OUT / f"hessian_pins_{tokens}.yaml", records, seq_len, dataset=folder,
                                 spec={"micro_batch_tokens": 8192})
    peak = 0
    record = statistics.Hessian.record

    def measured(self: statistics.Hessian, name: str, x) -> None:
        nonlocal peak
        record(self, name, x)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for rows in self.pending.values() for t in rows}
        peak = max(peak, sum(storages.values()))

    out = BENCH_OUT / "hessian_pins_out"
    shutil.rmtree(out, ignore_errors=True)
    statistics.Hessian.record = measured
    try:
        cli(["quant", "--model_path", str(model), "--save_path", str(out), "--device", "cpu", "--model_type",
             "Kimi-K3", "--config_path", str(practice), "--trust_remote_code", "True"])
    finally:
        statistics.Hessian.record = record
        shutil.rmtree(out, ignore_errors=True)
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="16384,65536")
    args = p.parse_args()
    model = shrunk_layer_checkpoint()
    sizes = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        sizes[tokens] = round(pinned_peak(model, tokens) / 2**20, 1)
        print(f"{tokens} tokens: {sizes[tokens]} MiB held by pending Hessian rows", flush=True)
    print_result({"bench": "hessian_pins", "machine": machine(), "tree": str(ROOT), "model": model.name,
                  "pending_rows_peak_mib": sizes})


if __name__ == "__main__":
    main()
