# SPDX-License-Identifier: Apache-2.0
"""build.sh's final gate (csrc_gfx936/check_offload.py --wheel) on fake ROCm wheels.

The shared objects are real ELF files made by gcc; the device ones get a `.hip_fatbin` section
(what hipcc emits) added with binutils' objcopy, holding an offload bundle written here from the
format clang documents. readelf (binutils) is the independent reader of the ELF side.

Regression (issue #17): the gate required gfx936 code in every .so, so vLLM's host-only
objects (cumem_allocator, spinloop, fs_io_C) made every ROCm build die at its last step.
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "csrc_gfx936" / "check_offload.py"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "objcopy", "readelf")),
    reason="needs gcc and binutils (objcopy, readelf) to make real ELF shared objects")


def bundle(*arches: str) -> bytes:
    """An uncompressed clang offload bundle: host entry + one hipv4 entry per arch."""
    triples = ["host-x86_64-unknown-linux-gnu-"] + [f"hipv4-amdgcn-amd-amdhsa--{a}" for a in arches]
    images = [b""] + [b"\x7fELF fake code object for " + a.encode() for a in arches]
    head = len(b"__CLANG_OFFLOAD_BUNDLE__") + 8 + sum(24 + len(t) for t in triples)
    entries, off = b"", head
    for t, img in zip(triples, images):
        entries += struct.pack("<QQQ", off, len(img), len(t)) + t.encode()
        off += len(img)
    return b"__CLANG_OFFLOAD_BUNDLE__" + struct.pack("<Q", len(triples)) + entries + b"".join(images)


def ccob_zlib(inner: bytes, version: int = 2) -> bytes:
    """A compressed bundle (clang's CCOB header, method 0 = zlib)."""
    body = zlib.compress(inner)
    if version == 2:
        return b"CCOB" + struct.pack("<HHIIQ", 2, 0, 24 + len(body), len(inner), 0) + body
    return b"CCOB" + struct.pack("<HHQQQ", 3, 0, 32 + len(body), len(inner), 0) + body


def shared_object(tmp: Path, name: str, fatbin: bytes | None = None) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(f"int {name.replace('.', '_')}_entry(void) {{ return 42; }}\n")
    so = tmp / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
    if fatbin is not None:
        blob = tmp / f"{name}.fatbin"
        blob.write_bytes(fatbin)
        subprocess.run(["objcopy", "--add-section", f".hip_fatbin={blob}", so], check=True)
    sections = subprocess.run(["readelf", "-S", "-W", so], capture_output=True, text=True,
                              check=True).stdout
    assert (".hip_fatbin" in sections) == (fatbin is not None)
    return so


def wheel(tmp: Path, members: dict[str, Path]) -> Path:
    whl = tmp / "vllm-0.27.1+gfx936.dtk2604.s3-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for arc, path in members.items():
            z.write(path, arc)
        z.writestr("vllm-0.27.1+gfx936.dtk2604.s3.dist-info/RECORD", "")
    return whl


def run_check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--want", "gfx936", *args],
                          capture_output=True, text=True)


@pytest.fixture
def objs(tmp_path):
    return {
        "host": shared_object(tmp_path, "cumem_allocator"),
        "host2": shared_object(tmp_path, "spinloop"),
        "c936": shared_object(tmp_path, "C", bundle("gfx936")),
        "k936": shared_object(tmp_path, "gfx936_C", bundle("gfx936", "gfx90a")),
        "c90a": shared_object(tmp_path, "C90a", bundle("gfx90a")),
        "ccob": shared_object(tmp_path, "moe_C", ccob_zlib(bundle("gfx936"))),
        "ccob90a": shared_object(tmp_path, "moe90a_C", ccob_zlib(bundle("gfx90a"), version=3)),
    }


def test_wheel_with_host_only_objects_passes(tmp_path, objs):
    whl = wheel(tmp_path, {"vllm/_C.abi3.so": objs["c936"],
                           "vllm/cumem_allocator.abi3.so": objs["host"],
                           "vllm/spinloop.abi3.so": objs["host2"],
                           "vllm/_moe_C.abi3.so": objs["ccob"],
                           "vllm/_gfx936_C.so": objs["k936"]})
    r = run_check("--wheel", whl)
    assert r.returncode == 0, r.stdout
    assert "vllm/cumem_allocator.abi3.so: host-only" in r.stdout
    assert "vllm/_moe_C.abi3.so: gfx936 code present" in r.stdout  # zlib CCOB read
    assert "vllm/_gfx936_C.so: gfx936 code present (bundle targets: gfx90a, gfx936)" in r.stdout


def test_wheel_with_a_gfx90a_only_kernel_fails_naming_it(tmp_path, objs):
    whl = wheel(tmp_path, {"vllm/_C.abi3.so": objs["c90a"],
                           "vllm/cumem_allocator.abi3.so": objs["host"],
                           "vllm/_gfx936_C.so": objs["k936"]})
    r = run_check("--wheel", whl)
    assert r.returncode == 1
    assert "FAIL: vllm/_C.abi3.so: no gfx936 code; bundle targets: gfx90a" in r.stdout


def test_compressed_gfx90a_only_bundle_fails(tmp_path, objs):
    whl = wheel(tmp_path, {"vllm/_moe_C.abi3.so": objs["ccob90a"],
                           "vllm/_gfx936_C.so": objs["k936"]})
    r = run_check("--wheel", whl)
    assert r.returncode == 1
    assert "FAIL: vllm/_moe_C.abi3.so: no gfx936 code; bundle targets: gfx90a" in r.stdout


def test_wheel_without_device_code_or_kernel_library_fails(tmp_path, objs):
    r = run_check("--wheel", wheel(tmp_path, {"vllm/cumem_allocator.abi3.so": objs["host"]}))
    assert r.returncode == 1
    assert "no shared object carries device code" in r.stdout and "lacks vllm/_gfx936_C" in r.stdout
    r = run_check("--wheel", wheel(tmp_path, {"vllm/_C.abi3.so": objs["c936"]}))
    assert r.returncode == 1 and "lacks vllm/_gfx936_C" in r.stdout


def test_single_file_mode_still_requires_the_arch_in_each_file(objs):
    r = run_check(objs["c936"], objs["host"])
    assert r.returncode == 1
    assert "gfx936 code present" in r.stdout
    assert f"{objs['host']}: no gfx936 code; no device code" in r.stdout


def test_usage_errors_name_the_fault(tmp_path):
    r = run_check("--wheel", tmp_path / "missing.whl")
    assert r.returncode == 1 and "missing.whl: no such file" in r.stdout
    r = run_check()
    assert r.returncode == 2 and "give FILE... or --wheel" in r.stderr
