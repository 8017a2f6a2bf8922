"""Kernel tests: Triton under its CPU interpreter (set before triton is imported); the AMD
compile check of csrc_gfx936, run once per session and shared by the tests that read it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # fp8_ds_mla_writer


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gfx90a_kernel_check(tmp_path_factory):
    """(CompletedProcess, out dir) of csrc_gfx936/compile_check.sh --arch gfx90a on the kernels,
    with the checked-in allow-list (what CI and `make kernel-check` run)."""
    if shutil.which("hipcc") is None:
        pytest.skip("no hipcc on PATH (Debian: apt-get install hipcc); AMD compile check skipped")
    out = tmp_path_factory.mktemp("kernel-check")
    done = subprocess.run([str(REPO / "csrc_gfx936" / "compile_check.sh"), "--arch", "gfx90a",
                           "--out", str(out)], capture_output=True, text=True, timeout=1800)
    return done, out


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="where the Triton kernel tests that support it run: cpu (the interpreter, the "
             "default) or cuda (compiled, the H200 tier; vllm imported from the modules "
             "bench/stage.py staged into .device/layer when vLLM cannot be imported)")


def pytest_configure(config):
    if config.getoption("--device", default="cpu") == "cpu":
        return
    os.environ["TRITON_INTERPRET"] = "0"  # triton is not imported yet
    try:
        import vllm.platforms  # noqa: F401  (a full vLLM install)
    except Exception:  # noqa: BLE001 - the GPU machine has torch and triton only
        staged = REPO / ".device" / "layer"
        if not (staged / "STAGED.json").is_file():
            raise pytest.UsageError(f"--device cuda without vLLM needs {staged}: run "
                                    "`python3 bench/stage.py` where the series is applied")
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        sys.path.insert(0, str(staged))
