"""`longspec export-drafter`: an EAGLE-3 or DFlash drafter checkpoint written in the layout another engine loads
(speculators for vLLM, SpecForge for SGLang, z-lab DFlash), its tap ids in that layout's own convention."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longspec_jax.argtypes import add_command, positive_int
from longspec_jax.inference.cli.flags import dtype_arg

if TYPE_CHECKING:
  import argparse


def cmd_export_drafter(a: argparse.Namespace) -> int:
  from longspec_jax.hf_drafter_formats import export_drafter
  out = export_drafter(a.drafter_dir, a.format, a.out, dtype=a.dtype, verifier=a.verifier,
                       num_target_layers=a.num_target_layers, speculative_tokens=a.speculative_tokens)
  print(f"wrote {a.format} layout to {out}")
  return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
  from longspec_jax.hf_drafter_formats import FORMATS
  e = add_command(sub, "export-drafter", "write an EAGLE-3 / DFlash drafter in the speculators, SpecForge or z-lab "
                  "layout",
      "Write the drafter checkpoint DRAFTER_DIR (ours, or any layout the loaders read) in\n"
      "the layout another engine loads: speculators (vLLM; EAGLE-3 and DFlash), specforge\n"
      "(SGLang's LlamaForCausalLMEagle3; EAGLE-3 without q/k norms) or zlab (DFlash).\n"
      "Tap ids are written in that layout's convention (README: Bring your drafter, serve it).")
  e.add_argument("drafter_dir", help="the drafter checkpoint directory (config.json + model.safetensors)")
  e.add_argument("--format", required=True, choices=FORMATS, help="the layout to write")
  e.add_argument("--out", required=True, help="output directory")
  e.add_argument("--dtype", type=dtype_arg(("bfloat16", "float32")), default="bfloat16",
                 help="storage dtype of the floating tensors")
  e.add_argument("--verifier", help="the target's name or path, recorded in a speculators config (speculators "
                                    "reloads the target's embedding from it)")
  e.add_argument("--num-target-layers", type=positive_int,
                 help="the target's layer count: bounds the tap ids (needed to read a speculators DFlash source)")
  e.add_argument("--speculative-tokens", type=positive_int, default=3,
                 help="draft length an EAGLE-3 speculators config proposes")
  e.set_defaults(fn=cmd_export_drafter)
