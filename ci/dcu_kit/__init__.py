# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cluster validation kit for vllm-gfx936 (plain Python, outside the vllm tree).

Modules:
  verdict        pure verdict over generated token ids (+ logprobs)
  first_blocker  earliest main-path failure in a raw log (CLI)
  probe          staged single-node probe run (CLI, needs vLLM)
  compare        per-layer hidden-state / top-k logits dump and compare (CLI)
  ray_cluster    multi-node Ray launcher: command builders + runner (CLI)
  serve_smoke    OpenAI API smoke test against a running server (CLI)
  matrix         prompt builders for the regression matrix (tests/cluster)

Run the CLIs with ``PYTHONPATH=ci python -m dcu_kit.<module> --help``.
"""
