"""Stores a checkpoint directory's large matrices as int8 with one fp32 scale per output row (hf_io.write_int8_copy),
halving a bf16 drafter on disk; the loaders read such a copy back as fp32 unchanged. It records the storage in the
copy's drafter.json, if it has one. Check what it costs before shipping a copy, e.g. with scripts/store_eval.py:

  python scripts/quantize_checkpoint.py --src runs/drafter_eagle3_smollm2_store/final --out runs/eagle3_int8
"""

import argparse
import json
from pathlib import Path

from longspec_jax.hf_io import write_int8_copy


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--src", required=True, action="append",
                 help="checkpoint directory (config.json + model.safetensors); repeat with --out for several")
  p.add_argument("--out", required=True, action="append", help="new directory for the int8 copy (one per --src)")
  p.add_argument("--min-size", type=int, default=65536, help="matrices with fewer entries stay as they are")
  a = p.parse_args()
  if len(a.src) != len(a.out):
    p.error(f"give one --out per --src (got {len(a.src)} --src, {len(a.out)} --out)")
  for src, out in zip(a.src, a.out):
    stats = write_int8_copy(src, out, a.min_size)
    info = Path(out) / "drafter.json"
    if info.exists():
      d = json.loads(info.read_text())
      d["weights_storage"] = {"int8_per_output_row_matrices": stats["int8_tensors"], "min_size": a.min_size,
                              "command": f"python scripts/quantize_checkpoint.py --src {src} --out {out}"}
      info.write_text(json.dumps(d, indent=1))
    print(f"{out}: {stats['int8_tensors']} matrices int8, model.safetensors {stats['bytes_before'] / 1e6:.2f} MB "
          f"-> {stats['bytes_after'] / 1e6:.2f} MB")


if __name__ == "__main__":
  main()
