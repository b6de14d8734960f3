#!/bin/bash
# Repeat the msModelSlim 26.1.0 FA3 reference runs (CPU). W = work dir holding venv/, hf/, tiny_kimi_k2/
# (built as in ../msmodelslim_26.1_kimi_k2_w4a8_layout.md) and out_w4a8/ (the plain W4A8 run, for the comparison).
set -e
W=${W:-/tmp/msms_ref}; HERE=$(cd "$(dirname "$0")" && pwd)
export HF_HOME=$W/hf OMP_NUM_THREADS=2
# model variant with the original remote-code MLA attention (same weights): modeling_deepseek_rc.py is the stand-in's
# modeling file with DeepSeek-V3's public remote-code attention (not kept here; see ../msmodelslim_26.1_fa3_layout.md section 0)
rm -rf $W/tiny_kimi_k2_rc && cp -r $W/tiny_kimi_k2 $W/tiny_kimi_k2_rc && cp $HERE/modeling_deepseek_rc.py $W/tiny_kimi_k2_rc/modeling_deepseek.py
for n in int8_per_head fp8_per_head details_fp8; do
  rm -rf $W/out_fa3_$n
  $W/venv/bin/python $HERE/run_fa3.py quant --model_type Kimi-K2-Thinking --model_path $W/tiny_kimi_k2_rc \
    --save_path $W/out_fa3_$n --device cpu --config_path $HERE/kimi_w4a8_fa3_$n.yaml --trust_remote_code True \
    > $W/run_fa3_$n.log 2>&1
done
# optional: instrumented int8 run (records the observers' inputs) + scale recomputation
rm -rf $W/out_check_int8
FA3_RECORD=$W/fa3_record_int8.pt $W/venv/bin/python $HERE/run_fa3_check.py quant --model_type Kimi-K2-Thinking \
  --model_path $W/tiny_kimi_k2_rc --save_path $W/out_check_int8 --device cpu \
  --config_path $HERE/kimi_w4a8_fa3_int8_per_head.yaml --trust_remote_code True > $W/run_check_int8.log 2>&1
$W/venv/bin/python $HERE/check_fa3_scales.py $W/fa3_record_int8.pt $W/out_check_int8 127 > $W/fa3_int8_scale_check.json
cd $W
$W/venv/bin/python $HERE/analyze_fa3.py $W/out_fa3_int8_per_head $W/out_fa3_fp8_per_head $W/out_fa3_details_fp8 > $W/fa3_analysis.json
