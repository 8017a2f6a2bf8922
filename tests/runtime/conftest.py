"""Runtime tests import the patched vLLM (installed python-only by `make test`).

Triton kernels run on the CPU through Triton's interpreter. The switch must be set before anything
imports triton (vllm.envs does, indirectly), so it is set here, when pytest loads this conftest.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
