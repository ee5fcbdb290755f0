"""Run benchmarks by name (default: all) and write ``benchmarks/results/NAME.{json,md}``.

python benchmarks/run.py                 # every benchmark
python benchmarks/run.py config_parse    # one
python benchmarks/run.py --quick         # small sizes (smoke test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._harness import print_record, run_benchmark  # noqa: E402


def available() -> list[str]:
    """The benchmark modules: those defining a TITLE (gpu_wheels.py, a helper script, does not)."""
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_") and "\nTITLE = " in p.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all): {', '.join(available())}")
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")
    args = parser.parse_args(argv)
    names = args.names or available()
    unknown = sorted(set(names) - set(available()))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    for name in names:
        print_record(run_benchmark(name, quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
