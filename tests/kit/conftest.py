# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests of the cluster validation kit (ci/dcu_kit, ci/slurm)."""

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
KIT_PATH = REPO_ROOT / "ci"
if str(KIT_PATH) not in sys.path:
    sys.path.insert(0, str(KIT_PATH))
