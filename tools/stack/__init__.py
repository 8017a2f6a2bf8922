"""Patch-stack tooling of vllm-gfx936: pinned upstream, series, apply/refresh/check, wheel."""
