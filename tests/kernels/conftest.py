"""Kernel tests: Triton under its CPU interpreter (set before triton is imported)."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # fp8_ds_mla_writer
