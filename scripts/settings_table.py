"""Write (or with --check, compare) the README's settings table from the settings class.

.venv/bin/python scripts/settings_table.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.api.settings import markdown_table  # noqa: E402

HEADER = "| variable | default | what |\n|---|---|---|\n"


def replace_table(readme: str) -> str:
    """``readme`` with the rows after the settings table header replaced."""
    start = readme.index(HEADER) + len(HEADER)
    end = start
    lines = readme[start:].split("\n")
    for line in lines:
        if not line.startswith("|"):
            break
        end += len(line) + 1
    return readme[:start] + "\n".join(markdown_table()) + "\n" + readme[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's table is not current")
    args = parser.parse_args()
    path = ROOT / "README.md"
    text = path.read_text()
    new = replace_table(text)
    if args.check:
        if new != text:
            sys.stderr.write("README.md: the settings table is out of date; run scripts/settings_table.py\n")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
