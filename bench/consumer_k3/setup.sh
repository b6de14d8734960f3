#!/usr/bin/env bash
# The consumer of bench/consumer_k3.py: vllm-ascend's branch releases/v0.26.0rc (from a `fetch` of
# github:vllm-project/vllm-ascend) and vLLM 0.26.0 (its Dockerfile's VLLM_TAG) in a CPU venv of their own.
#   bash bench/consumer_k3/setup.sh DIR [VLLM_ASCEND_GIT_DIR]      (about 2 GB; 1-2 min with a warm pip cache)
# vLLM 0.26.0 pins torch 2.11.0, a CUDA build on PyPI that cannot import without the NVIDIA libraries: the venv
# takes a CPU torch (TORCH_WHEEL, or torch==2.13.0 from the index) and vLLM without its dependencies, then the
# pure-Python ones its import path needs. Packages that declare torch go in --no-deps (pip would pull CUDA torch).
set -euo pipefail
DIR=${1:?usage: setup.sh DIR [VLLM_ASCEND_GIT_DIR]}
GIT=${2:-/work/.mirror/vllm-project+vllm-ascend/repo}
PY=${PYTHON:-python3.11}
mkdir -p "$DIR/dl" "$DIR/vllm-ascend" "$DIR/meta/vllm_ascend-0.26.0rc0.dist-info"
[ -d "$DIR/vllm-ascend/vllm_ascend" ] || git -C "$GIT" archive releases/v0.26.0rc | tar -x -C "$DIR/vllm-ascend"
# an installed vllm-ascend registers its platform and models through these entry points
cat > "$DIR/meta/vllm_ascend-0.26.0rc0.dist-info/METADATA" <<'M'
Metadata-Version: 2.1
Name: vllm_ascend
Version: 0.26.0rc0
M
cat > "$DIR/meta/vllm_ascend-0.26.0rc0.dist-info/entry_points.txt" <<'M'
[vllm.platform_plugins]
ascend = vllm_ascend:register

[vllm.general_plugins]
ascend_model = vllm_ascend:register_model
M
ls "$DIR"/dl/vllm-0.26.0-*.whl >/dev/null 2>&1 || pip download -q --no-deps vllm==0.26.0 -d "$DIR/dl"
[ -x "$DIR/venv/bin/python" ] || "$PY" -m venv "$DIR/venv"
P="$DIR/venv/bin/pip"
"$P" install -q -U pip
"$P" install -q "${TORCH_WHEEL:-torch==2.13.0}"
"$P" install -q --no-deps "$DIR"/dl/vllm-0.26.0-*.whl
"$P" install -q transformers==5.14.1 pydantic msgspec cachetools psutil einops requests blake3 cloudpickle pyzmq \
  py-cpuinfo 'setuptools<81' sentencepiece pillow cbor2 aiohttp openai-harmony openai pybase64 uvloop \
  prometheus_client loguru partial-json-parser fastapi numpy
"$P" install -q --no-deps 'llguidance<1.8' 'xgrammar<1' apache-tvm-ffi compressed-tensors==0.17.0
du -sh "$DIR/venv"
