#!/usr/bin/env python3
"""Instrumented variant of run_fa3.py, for checking only: additionally records every tensor that
msModelSlim's FA3 observer (_FA3PerHeadObserver) sees during calibration, and dumps them to
$FA3_RECORD (a torch .pt: {observer_name: [tensor, ...]}). Observer behaviour is unchanged
(the original forward is still called)."""
import atexit, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_fa3  # noqa: F401  (applies the KimiK2 FA3 adapter patch)
from msmodelslim.processor.quant.fa3 import processor as fa3p

REC = {}
_orig_forward = fa3p._FA3PerHeadObserver.forward


def _rec_forward(self, x):
    REC.setdefault(self._name, []).append(x.detach().to(torch.float32).clone())
    return _orig_forward(self, x)


fa3p._FA3PerHeadObserver.forward = _rec_forward
atexit.register(lambda: torch.save(REC, os.environ["FA3_RECORD"]))

if __name__ == "__main__":
    from msmodelslim.cli.__main__ import main
    sys.argv = ["msmodelslim"] + sys.argv[1:]
    main()
