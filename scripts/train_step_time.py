"""Median training-step time of a drafter config under override variants, each run the way users run it
(`longspec train-drafter`, a fresh out_dir, the store's own batches), e.g. the draft vocabulary's cost:

  python scripts/train_step_time.py --drafter dflash --config configs/drafter_dflash_smollm2_store.yaml \\
      --variant draft_vocab_size=0 --variant draft_vocab_size=8192 --steps 14 --out results/x.json

A variant is comma-separated `--set` overrides. Steps log one by one; the first `--skip` steps (compilation, first
reads) are left out of the median. Time it with nothing else running.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--drafter", required=True)
  p.add_argument("--config", required=True)
  p.add_argument("--variant", action="append", required=True, help="comma-separated overrides, e.g. a=1,b=2")
  p.add_argument("--steps", type=int, default=14)
  p.add_argument("--skip", type=int, default=4, help="first steps left out of the median")
  p.add_argument("--out", help="JSON file for the results")
  a = p.parse_args()
  if a.steps <= a.skip + 1:
    raise SystemExit(f"--steps ({a.steps}) must exceed --skip + 1 ({a.skip + 1})")
  results = []
  for variant in a.variant:
    with tempfile.TemporaryDirectory() as out_dir:
      sets = [f"out_dir={out_dir}", f"steps={a.steps}", "log_every=1", "eval_every=0",
              "checkpoint_every_minutes=1000.0"] + [s for s in variant.split(",") if s]
      cmd = ["longspec", "train-drafter", "--drafter", a.drafter, "--config", a.config, "--no-resume"]
      for s in sets:
        cmd += ["--set", s]
      print("+", " ".join(cmd), flush=True)
      subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ)
      log = [json.loads(l) for l in (Path(out_dir) / "train_log.jsonl").read_text().splitlines() if l.strip()]
    elapsed = [r["elapsed_s"] for r in log if "elapsed_s" in r]
    steps = [b - a_ for a_, b in zip(elapsed, elapsed[1:])][a.skip:]
    results.append({"variant": variant, "median_step_s": round(statistics.median(steps), 3),
                    "steps_timed": len(steps), "first_logged_s": elapsed[0]})
    print(json.dumps(results[-1]), flush=True)
  report = {"command": " ".join(["python"] + sys.argv), "drafter": a.drafter, "config": a.config,
            "load_1min": os.getloadavg()[0], "results": results}
  if a.out:
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
