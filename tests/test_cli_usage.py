"""What a new user meets first: `longspec --help` (fast, no jax), flag validation before anything loads, one
exit-code convention (2 for every usage or input error) with plain messages, progress on stderr, and the
README's newcomer commands."""

import argparse
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from longspec_jax.inference.cli import build_parser, main
from longspec_jax.argtypes import nonneg_float, nonneg_int, positive_int, unit_float

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=60):
  return subprocess.run([sys.executable, "-m", "longspec_jax.inference.cli", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def _subparsers(parser):
  (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
  return action.choices


def _int_flags():
  """(subcommand or None for the top level, flag, type) of every integer flag."""
  parser = build_parser()
  out = []
  for name, sp in [(None, parser), *_subparsers(parser).items()]:
    for a in sp._actions:
      if a.type in (int, positive_int, nonneg_int):
        out.append((name, a.option_strings[-1], a.type))
  return out


def test_every_int_flag_is_validated():
  flags = _int_flags()
  assert ("bench", "--context", positive_int) in flags and ("generate", "--max-prompt-tokens", positive_int) in flags
  assert len(flags) >= 25 and (None, "--num-processes", positive_int) in flags
  for cmd, flag, typ in flags:
    assert typ is not int, f"{cmd} {flag} accepts any integer"
    bad = ["0", "-1"] if typ is positive_int else ["-1"]
    for v in bad + ["x"]:
      with pytest.raises(SystemExit) as e:
        build_parser().parse_args(([cmd] if cmd else []) + [flag, v])
      assert e.value.code == 2, (cmd, flag, v)


def test_value_types():
  assert positive_int("3") == 3 and nonneg_int("0") == 0 and nonneg_float("0.5") == 0.5 and unit_float("1") == 1
  for fn, text in ((positive_int, "0"), (nonneg_int, "-2"), (nonneg_float, "-0.1"), (nonneg_float, "nan"),
                   (unit_float, "0"), (unit_float, "1.5")):
    with pytest.raises(argparse.ArgumentTypeError):
      fn(text)


def test_newcomer_defects_exit_2_at_once():
  """`bench --context 0` used to benchmark a whole document; `--max-prompt-tokens -1` dropped a token."""
  doc = ROOT / "longspec_jax/assets/long_docs/inspect.py.txt"
  cases = [
      (["bench", "--method", "ar", "--text-file", str(doc), "--context", "0"], "--context: must be a positive"),
      (["generate", "--prompt", "x", "--max-prompt-tokens", "-1"], "--max-prompt-tokens: must be a positive"),
      (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature: must be >= 0"),
      (["generate", "--prompt-file", "/nonexistent/p.txt"], "prompt file /nonexistent/p.txt not found"),
      (["bench", "--method", "ar", "--text-file", "/nonexistent/t.txt", "--context", "8"],
       "text file /nonexistent/t.txt not found"),
      (["bench", "--method", "prompt-lookup", "--text-file", str(doc), "--context", "8", "--sharpdraft", "fixed"],
       "has none"),
      (["bench", "--method", "nope", "--text-file", str(doc), "--context", "8"], "invalid choice: 'nope'"),
      (["generate", "--prompt", "x", "--method", "eagle3", "--tree", "0;1.1"], "has no parent path (1,)"),
      (["generate", "--prompt", "x", "--method", "eagle3", "--tree", "0", "--temperature", "1"],
       "--tree verifies greedily"),
      (["bench", "--method", "eagle3", "--text-file", str(doc), "--context", "8", "--tree", "t.json#8"],
       "tree file t.json not found"),
  ]
  for args, msg in cases:
    t0 = time.perf_counter()
    r = _run(*args)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert msg in r.stderr and "Errno" not in r.stderr, (args, r.stderr)
    assert "Traceback" not in r.stderr
    assert time.perf_counter() - t0 < 20, args  # rejected before any model loads


def test_file_errors_in_words(tmp_path, capsys):
  assert main(["eval-target", "--text-file", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert "is not a file" in err and "Errno" not in err
  # An OSError raised by the OS itself (not by a check of ours) is reported without "[Errno N]".
  (tmp_path / "f").write_text("")
  assert main(["export-hf", "--out", str(tmp_path / "f" / "out")]) == 2
  err = capsys.readouterr().err
  assert "longspec export-hf: error: not a directory" in err and "Errno" not in err


def test_help_is_fast_and_imports_no_jax():
  code = ("import sys, longspec_jax.inference.cli as c; p = c.build_parser(); "
          "assert 'jax' not in sys.modules and 'numpy' not in sys.modules, 'parser imports jax/numpy'; "
          "from longspec_jax.drafters import method_names; "
          "bench = [a for a in p._actions if hasattr(a, 'choices') and a.choices and 'bench' in a.choices][0]"
          ".choices['bench']; "
          "m = [a for a in bench._actions if '--method' in a.option_strings][0]; "
          "assert list(m.choices) == method_names(), m.choices")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  r = _run("--help")
  assert r.returncode == 0 and "speculative decoding" in r.stdout and "contract" not in r.stdout
  r = _run("bench", "--help")
  assert "tau " in r.stdout and "speedup " in r.stdout and "prompt-lookup" in r.stdout
  r = _run("generate", "--help")
  for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--model", "--quiet"):
    line = r.stdout[r.stdout.index(f"  {flag}"):].split("\n  -")[0]
    assert len(line.split()) > 3, f"{flag} has no help text: {line!r}"
  assert "(default: 64)" in r.stdout


def test_packaging_and_newcomer_commands():
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "setuptools>=77" in meta["build-system"]["requires"]
  assert meta["project"]["license"] == "Apache-2.0"
  assert not any(d.startswith("pytest") for d in meta["project"]["dependencies"]), "pytest is not a runtime dep"
  test_extra = meta["project"]["optional-dependencies"]["test"]
  assert any(d.startswith("pytest-xdist") for d in test_extra) and any(d.startswith("pytest>") for d in test_extra)
  # The README's test command works on a fresh machine as written (it installs the test extra it needs), and CI
  # runs exactly that command.
  readme = (ROOT / "README.md").read_text()
  block = readme[readme.index("Run the tests"):].split("```bash\n")[1].split("\n```")[0].strip()
  assert block.startswith('pip install -e ".[test]" && ') and "-n 2" in block
  assert block in (ROOT / ".ci/run").read_text().splitlines()
