"""Runtime tests import the patched vLLM (installed python-only by `make test`).

Triton kernels run on the CPU through Triton's interpreter. The switch must be set before anything
imports triton (vllm.envs does, indirectly), so it is set here, when pytest loads this conftest.

GFX936_TEST_VLLM_TREE (test-only, not a product switch): the root of a vLLM source checkout
(the directory holding the `vllm/` package, e.g. this repo's `vllm/` or a rebase's scratch tree
build/rebase-X/tests-tree) to import instead of the installed vllm. `make rebase --run-tests`
sets it to run each patch's tests on the new upstream without that patch.
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

_TREE = os.environ.get("GFX936_TEST_VLLM_TREE")
if _TREE:
    _root = Path(_TREE).resolve()
    if not (_root / "vllm" / "__init__.py").is_file():
        raise RuntimeError(f"GFX936_TEST_VLLM_TREE={_TREE}: no vllm/__init__.py under it; give the "
                           "root of a vLLM source checkout (the directory that holds the vllm package)")
    sys.path.insert(0, str(_root))
    for _name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[_name]  # nothing of another vllm may stay imported
