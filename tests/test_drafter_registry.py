"""The drafter registry: records read from the drafter modules' source are the ones the modules define, each names
a loader that exists, and every spec declares `max_draft_tokens`."""

import dataclasses
import importlib
import subprocess
import sys

from longspec_jax.drafters import ENTRIES, drafter_entry, method_names


def test_records_read_from_source_are_the_modules_own():
  for name, entry in ENTRIES.items():
    mod = importlib.import_module(entry.module)
    assert dataclasses.replace(entry, module="") in mod.DRAFTERS, name
    assert callable(getattr(mod, entry.loader)), name
  assert method_names() == ["ar"] + sorted(ENTRIES) and drafter_entry("budget").options == ("budget",)


def test_listing_methods_imports_no_jax():
  code = ("import sys; from longspec_jax.drafters import method_names; "
          "from longspec_jax.inference.cli.train import TRAINABLE; method_names(); "
          "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy')]")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr


def test_default_k_reads_the_declared_limit():
  from longspec_jax.drafters.base import default_num_draft, max_draft_tokens
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
  spec = PromptLookupDrafter(vocab_size=8)
  assert max_draft_tokens(spec) is None and default_num_draft(spec) == 8
