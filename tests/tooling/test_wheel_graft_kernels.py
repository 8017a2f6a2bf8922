"""The ROCm wheel ships csrc_gfx936's library: build.sh builds it into build/kernels, and the wheel
is built from an exported tree that never sees the checkout's vllm/ folder, so the wheel step
grafts it in (a reviewer found `./build.sh` would otherwise fail at its last check)."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from tools.stack import wheel
from tools.stack.errors import StackError


def _toy_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm-0.dist-info/RECORD", "vllm/__init__.py,,0\nvllm-0.dist-info/RECORD,,\n")
    return path


def test_kernel_library_is_grafted_with_a_record_row_that_hashes_its_bytes(tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    data = b"\x7fELF fake gfx936 library"
    (kernels / "_gfx936_C.so").write_bytes(data)
    whl = _toy_wheel(tmp_path / "vllm-0-py3-none-any.whl")
    assert wheel.graft_gfx936_kernels(whl, kernels) == ["vllm/_gfx936_C.so"]
    with zipfile.ZipFile(whl) as z:
        assert z.read("vllm/_gfx936_C.so") == data
        rows = {r.split(",")[0]: r for r in z.read("vllm-0.dist-info/RECORD").decode().splitlines()}
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert rows["vllm/_gfx936_C.so"] == f"vllm/_gfx936_C.so,sha256={digest},{len(data)}"
    assert rows["vllm-0.dist-info/RECORD"].endswith(",,")
    # Idempotent: a second graft adds nothing.
    assert wheel.graft_gfx936_kernels(whl, kernels) == []


def test_missing_kernel_library_is_a_clear_error(tmp_path):
    whl = _toy_wheel(tmp_path / "vllm-0-py3-none-any.whl")
    with pytest.raises(StackError, match="no _gfx936_C"):
        wheel.graft_gfx936_kernels(whl, tmp_path / "empty")
