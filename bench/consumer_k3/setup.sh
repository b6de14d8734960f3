#!/usr/bin/env bash
# The consumer of bench/consumer_k3.py: a vllm-ascend tree (a ref of a `fetch` of github:vllm-project/vllm-ascend)
# and the vLLM its Dockerfile pins, in a CPU venv of their own.
#   bash bench/consumer_k3/setup.sh DIR [REF] [VLLM_VERSION] [VLLM_ASCEND_GIT_DIR]
#   0.26: bash bench/consumer_k3/setup.sh /work/consumer    releases/v0.26.0rc 0.26.0     (the defaults)
#   0.27: bash bench/consumer_k3/setup.sh /work/consumer27  e4f0a9e5484c472cabbc76583d959996356e3076 0.27.1   (refs/pull/14454/head)
# vLLM pins a CUDA torch on PyPI that cannot import without the NVIDIA libraries: the venv takes a CPU torch
# (TORCH_WHEEL, or torch==2.13.0 from the CPU index) and vLLM without its dependencies, then the pure-Python ones its
# import path needs. Packages that declare torch go in --no-deps (pip would pull CUDA torch).
set -euo pipefail
DIR=${1:?usage: setup.sh DIR [REF] [VLLM_VERSION] [VLLM_ASCEND_GIT_DIR]}
REF=${2:-releases/v0.26.0rc}
VLLM=${3:-0.26.0}
GIT=${4:-/work/.mirror/vllm-project+vllm-ascend/repo}
PY=${PYTHON:-python3.11}
# the version vllm-ascend reports (only its dist-info reads it): the vLLM minor with rc0
VA=${VLLM_ASCEND_VERSION:-$(echo "$VLLM" | cut -d. -f1,2).0rc0}
mkdir -p "$DIR/dl" "$DIR/vllm-ascend" "$DIR/meta/vllm_ascend-$VA.dist-info"
[ -d "$DIR/vllm-ascend/vllm_ascend" ] || git -C "$GIT" archive "$REF" | tar -x -C "$DIR/vllm-ascend"
git -C "$GIT" rev-parse "$REF^{commit}" > "$DIR/vllm-ascend/COMMIT"
# an installed vllm-ascend registers its platform and models through these entry points
cat > "$DIR/meta/vllm_ascend-$VA.dist-info/METADATA" <<M
Metadata-Version: 2.1
Name: vllm_ascend
Version: $VA
M
cat > "$DIR/meta/vllm_ascend-$VA.dist-info/entry_points.txt" <<'M'
[vllm.platform_plugins]
ascend = vllm_ascend:register

[vllm.general_plugins]
ascend_model = vllm_ascend:register_model
M
ls "$DIR"/dl/vllm-"$VLLM"-*.whl >/dev/null 2>&1 || pip download -q --no-deps "vllm==$VLLM" -d "$DIR/dl"
[ -x "$DIR/venv/bin/python" ] || "$PY" -m venv "$DIR/venv"
P="$DIR/venv/bin/pip"
"$P" install -q -U pip
"$P" install -q "${TORCH_WHEEL:-torch==2.13.0}"
"$P" install -q --no-deps "$DIR"/dl/vllm-"$VLLM"-*.whl
"$P" install -q transformers==5.14.1 pydantic msgspec cachetools psutil einops requests blake3 cloudpickle pyzmq \
  py-cpuinfo 'setuptools<81' sentencepiece pillow cbor2 aiohttp openai-harmony openai pybase64 uvloop \
  prometheus_client loguru partial-json-parser fastapi numpy
"$P" install -q --no-deps 'llguidance<1.8' 'xgrammar<1' apache-tvm-ffi compressed-tensors==0.17.0
du -sh "$DIR/venv"
