"""The ROCm wheel's requirements cannot pull a second torch stack, and an unchanged tree is reused
(issue #17: `pip install` of the wheel pulled timm -> torchvision -> a PyPI torch; every
`./build.sh` started the hour-long compile over)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.stack import pin as pin_mod, wheel  # noqa: E402
from tools.stack.errors import StackError  # noqa: E402


def upstream_rocm_txt() -> str:
    """requirements/rocm.txt at the pristine pinned tag (the wheel is built from tag + series)."""
    if not (REPO / "vllm" / ".git").exists():
        pytest.skip("vllm/ holds no upstream: run `make upstream`")
    return subprocess.run(["git", "show", f"{pin_mod.load().tag}:requirements/rocm.txt"],
                          cwd=REPO / "vllm", capture_output=True, text=True, check=True).stdout


def names(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out[canonicalize_name(Requirement(line).name)] = line
    return out


def test_rocm_requirements_drop_exactly_the_torch_pulling_ones(tmp_path):
    text = upstream_rocm_txt()
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "rocm.txt").write_text(text)
    dropped = wheel.prepare_rocm_tree(tmp_path)
    assert sorted(dropped) == sorted(wheel.ROCM_SKIPPED_REQUIREMENTS)
    before, after = names(text), names((tmp_path / "requirements" / "rocm.txt").read_text())
    assert set(before) - set(after) == {canonicalize_name(n) for n in wheel.ROCM_SKIPPED_REQUIREMENTS}
    assert all(after[n] == before[n] for n in after)  # the rest is untouched
    assert "-r common.txt" in (tmp_path / "requirements" / "rocm.txt").read_text()


def test_a_skipped_name_upstream_no_longer_lists_is_an_error(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "rocm.txt").write_text(
        "\n".join(ln for ln in upstream_rocm_txt().splitlines() if not ln.startswith("timm")))
    with pytest.raises(StackError, match="no requirement timm to leave out"):
        wheel.prepare_rocm_tree(tmp_path)
    assert wheel.prepare_rocm_tree(tmp_path, reused=True)  # a reused tree had them removed before


def test_tree_is_reused_only_for_the_same_pin_flavour_and_patches(tmp_path):
    info = {"patches": [{"sha256": "a" * 64}, {"sha256": "b" * 64}], "fork_version": "x"}
    pin = pin_mod.load()
    stamp = wheel.tree_stamp(pin, "rocm", info)
    (tmp_path / "vllm" / "gfx936").mkdir(parents=True)
    assert not wheel.reuse_tree(tmp_path, stamp, info)  # no stamp yet
    (tmp_path / wheel.STAMP).write_text(stamp)
    assert wheel.reuse_tree(tmp_path, stamp, dict(info, fork_version="y"))
    assert "'fork_version': 'y'" in (tmp_path / "vllm" / "gfx936" / "_build_info.py").read_text()
    changed = dict(info, patches=[{"sha256": "a" * 64}, {"sha256": "c" * 64}])
    assert not wheel.reuse_tree(tmp_path, wheel.tree_stamp(pin, "rocm", changed), changed)
    assert not wheel.reuse_tree(tmp_path, wheel.tree_stamp(pin, "cpu", info), info)
