"""Import vLLM modules that define Triton kernels so they run under the CPU interpreter.

conftest.py sets TRITON_INTERPRET=1 before triton is imported. On a machine without a GPU driver
vLLM's `vllm.triton_utils` reports no Triton (placeholders), so a kernel module is imported with the
real `triton` / `triton.language` patched into `vllm.triton_utils` for the duration of the import.
"""
import importlib

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def import_with_real_triton(name: str):
    import vllm.triton_utils as vllm_triton_utils

    saved = (vllm_triton_utils.triton, vllm_triton_utils.tl)
    vllm_triton_utils.triton, vllm_triton_utils.tl = triton, tl
    try:
        return importlib.reload(importlib.import_module(name))
    finally:
        vllm_triton_utils.triton, vllm_triton_utils.tl = saved
