"""The README's gfx936 defaults table is the one the code applies (generated from
vllm/platforms/gfx936_defaults.py), so users never read a stale default or override."""
from __future__ import annotations

import re
from pathlib import Path

from vllm.platforms import gfx936_defaults
README = Path(__file__).resolve().parents[2] / "README.md"


def _table_rows(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("| `")]


def test_readme_defaults_table_equals_the_generated_table():
    block = re.search(r"<!-- defaults-table:begin -->\n(.*?)<!-- defaults-table:end -->",
                      README.read_text(), re.S)
    assert block, "README.md lost its defaults-table markers"
    generated = gfx936_defaults.defaults_markdown()
    main_table = generated.split("\n\n|")[1] if "\n\n|" in generated else generated
    want = [r for r in _table_rows("|" + main_table) if r.count("|") == 7]
    assert want and _table_rows(block.group(1)) == want
