# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark on the no-FP8 path (patch dsv4-dspark-refuse-no-fp8): its context-KV insert is
upstream's FP8 HIP kernel, so building the drafter there stops with an error that names MTP as
the way out, before any weight is touched; with FP8 conversion the check lets it through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.models.deepseek_v4.amd import dspark
from vllm.platforms import gfx936_capability


def test_dspark_is_refused_without_fp8_conversion(monkeypatch):
    monkeypatch.setattr(gfx936_capability, "lacks_fp8_conversion", lambda: True)
    with pytest.raises(NotImplementedError, match='"method": "mtp"'):
        dspark.DSparkDeepseekV4Model(vllm_config=SimpleNamespace(speculative_config=None))


def test_with_fp8_conversion_the_check_lets_dspark_through(monkeypatch):
    monkeypatch.setattr(gfx936_capability, "lacks_fp8_conversion", lambda: False)
    # past the check, upstream's own assert on the speculative config is what fails here
    with pytest.raises(AssertionError):
        dspark.DSparkDeepseekV4Model(vllm_config=SimpleNamespace(speculative_config=None))
