"""Write ``tests/durations.json`` (seconds per test file) from the output of ``pytest --durations=0``:
``python -m tests.durations LOG``. ``tests/conftest.py`` runs the longest groups first."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::")


def per_file(log: str) -> dict[str, float]:
    """The seconds of every setup, call and teardown in ``log``, summed per test file."""
    seconds: dict[str, float] = defaultdict(float)
    for match in LINE.finditer(log):
        seconds[match.group(2)] += float(match.group(1))
    return {path: round(value, 1) for path, value in sorted(seconds.items())}


def main(argv: list[str]) -> None:
    seconds = per_file(Path(argv[0]).read_text())
    if not seconds:
        sys.exit(f"no durations in {argv[0]}: run pytest with --durations=0")
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
