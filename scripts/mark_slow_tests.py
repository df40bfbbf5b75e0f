"""Writes, from a measured full run's `--durations=0` report:
- tests/slow_tests.txt, the tests the quick subset (`pytest -m "not slow"`) leaves out: every test whose setup + call
  took at least --threshold seconds;
- tests/module_seconds.txt, each test module's setup + call seconds summed, which tests/conftest.py orders the
  modules by (longest first) so that xdist's work stealing ends the run on short tests.

  python -m pytest -q -n 2 tests --durations=0 > runs/durations.txt
  python scripts/mark_slow_tests.py --durations runs/durations.txt --threshold 4

tests/conftest.py marks the listed tests slow (beside the ones marked in their files).
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(tests/\S+)$")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--durations", required=True, help="a pytest --durations=0 report")
  p.add_argument("--threshold", type=float, required=True, help="seconds of setup + call from which a test is slow")
  p.add_argument("--out", default=str(ROOT / "tests" / "slow_tests.txt"))
  p.add_argument("--module-out", default=str(ROOT / "tests" / "module_seconds.txt"))
  a = p.parse_args()
  seconds = defaultdict(float)
  for line in Path(a.durations).read_text().splitlines():
    m = LINE.match(line.strip())
    if m and m.group(2) != "teardown":
      seconds[m.group(3)] += float(m.group(1))
  slow = sorted(t for t, s in seconds.items() if s >= a.threshold)
  kept = sum(s for t, s in seconds.items() if s < a.threshold)
  header = [f"# The tests the quick subset leaves out: setup + call >= {a.threshold:g} s in a full run",
            f"# (python scripts/mark_slow_tests.py --durations FILE --threshold {a.threshold:g}). {len(slow)} of "
            f"{len(seconds)} timed tests, {sum(seconds[t] for t in slow):.0f} s; the rest {kept:.0f} s (both summed "
            "over the two workers)."]
  Path(a.out).write_text("\n".join(header + slow) + "\n")
  per_module = defaultdict(float)
  for test, secs in seconds.items():
    per_module[test.split("::")[0]] += secs
  rows = [f"{secs:.1f} {module}" for module, secs in sorted(per_module.items(), key=lambda kv: -kv[1])]
  Path(a.module_out).write_text("\n".join(["# seconds (setup + call, summed) and test module, from the run that wrote "
                                           "slow_tests.txt", *rows]) + "\n")
  print(f"{len(slow)} slow tests ({sum(seconds[t] for t in slow):.0f} s), {len(seconds) - len(slow)} quick "
        f"({kept:.0f} s summed) -> {a.out}")


if __name__ == "__main__":
  main()
