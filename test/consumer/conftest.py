"""Fixtures of the consumer tests: our outputs (built once) and vllm-ascend's quantization package on CPU."""

from __future__ import annotations

import pytest

from . import vllm_ascend_cpu as ascend
from .outputs import build_fallback_output, build_outputs


@pytest.fixture(scope="package")
def outputs(tmp_path_factory, tiny_k3_checkpoint):
    return build_outputs(tmp_path_factory.mktemp("consumer"), tiny_k3_checkpoint)


@pytest.fixture(scope="package")
def fallback_output(tmp_path_factory, tiny_k3_checkpoint):
    return build_fallback_output(tmp_path_factory.mktemp("fallback"), tiny_k3_checkpoint)


@pytest.fixture(scope="package")
def vllm_ascend(outputs, fallback_output):  # after the outputs: while it is imported, a stub torch_npu sits in sys.modules
    module = ascend.import_vllm_ascend()
    yield module
    ascend.remove_stubs()
