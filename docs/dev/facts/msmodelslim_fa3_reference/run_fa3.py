#!/usr/bin/env python3
"""Driver: run msModelSlim 26.1.0's normal `msmodelslim quant` CLI with the kimi_k2 adapter made
FA3-capable.

msModelSlim's FA3QuantProcessor requires `isinstance(adapter, FA3QuantAdapterInterface)`. The
kimi_k2 adapter (KimiK2ModelAdapter) does not implement that interface, but the deepseek_v3 adapter
does, for the same DeepSeek-V3 MLA attention class. So, before the CLI runs, this script:
  * defines KimiK2FA3ModelAdapter(KimiK2ModelAdapter, FA3QuantAdapterInterface) whose
    inject_fa3_placeholders IS DeepSeekV3ModelAdapter.inject_fa3_placeholders (same function object);
  * puts it in place of `KimiK2ModelAdapter` in msmodelslim.model.kimi_k2.model_adapter, which is
    where KimiK2AdapterLoader.ADAPTER_CLASS_PATH ("msmodelslim.model.kimi_k2.model_adapter:
    KimiK2ModelAdapter") is resolved (import_module + getattr).
Nothing else of msModelSlim is changed. All arguments are passed through to the CLI, e.g.
  python run_fa3.py quant --model_type Kimi-K2-Thinking --model_path M --save_path OUT \
      --device cpu --config_path PRACTICE.yaml --trust_remote_code True
"""
import sys

import msmodelslim.model.kimi_k2.model_adapter as kimi_mod
from msmodelslim.model.deepseek_v3.model_adapter import DeepSeekV3ModelAdapter
from msmodelslim.processor.quant.fa3 import FA3QuantAdapterInterface

_Orig = kimi_mod.KimiK2ModelAdapter


class KimiK2FA3ModelAdapter(_Orig, FA3QuantAdapterInterface):
    """KimiK2ModelAdapter + FA3QuantAdapterInterface (method borrowed from the deepseek_v3 adapter)."""
    inject_fa3_placeholders = DeepSeekV3ModelAdapter.inject_fa3_placeholders


KimiK2FA3ModelAdapter.__module__ = _Orig.__module__
kimi_mod.KimiK2ModelAdapter = KimiK2FA3ModelAdapter
assert issubclass(kimi_mod.KimiK2ModelAdapter, FA3QuantAdapterInterface)
print("[run_fa3] msmodelslim.model.kimi_k2.model_adapter.KimiK2ModelAdapter -> KimiK2FA3ModelAdapter "
      "(inject_fa3_placeholders from DeepSeekV3ModelAdapter)", flush=True)

if __name__ == "__main__":
    from msmodelslim.cli.__main__ import main
    sys.argv = ["msmodelslim"] + sys.argv[1:]
    main()
