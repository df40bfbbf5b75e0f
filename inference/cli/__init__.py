"""`longspec` command line: one module per command group (`generate`; `bench`; the target's; the drafters'), the
flag groups they share declared once in `flags`. Flags and JSON keys named in the issues are a contract: add, never
rename. Building the parser imports no jax, so `longspec --help` and a flag error answer at once."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from longspec_jax.argtypes import HelpFormatter, Parser, nonneg_int, positive_int

DESCRIPTION = """\
Long-context speculative decoding in JAX: generate with a target model (the shipped 8.4M default or an HF
Qwen3/Llama checkpoint), benchmark speculative methods against plain autoregression, and build the data, drafters
and calibrations they need. Every subcommand has its own --help."""

EPILOG = """\
examples:
  longspec generate --prompt "def fibonacci(n):" --max-new-tokens 64
  longspec bench --method pard --text-file longspec_jax/assets/long_docs/inspect.py.txt --context 1024

Errors in flags or inputs exit with status 2 before any model loads; Ctrl-C ends any command with status 130."""
INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def build_parser() -> argparse.ArgumentParser:
  from longspec_jax.inference.cli import bench, generate, interop, suffix, target, train

  p = Parser(prog="longspec", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
  dist = p.add_argument_group("multi-host runs (one process per host; scripts/tpu/run.sh passes --distributed)")
  dist.add_argument("--distributed", action="store_true",
                    help="join a multi-process JAX job first (jax.distributed.initialize); on a Cloud TPU slice "
                         "the coordinator, process count and id come from the TPU environment")
  dist.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address (process 0's host)")
  dist.add_argument("--num-processes", type=positive_int, help="processes in the job")
  dist.add_argument("--process-id", type=nonneg_int, help="this process's index, 0 .. num-processes - 1")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for group in (generate, bench, target, train, suffix, interop):
    group.add_commands(sub)
  return p


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
  """name -> (its parser, its one-line help), in the order `longspec --help` lists them."""
  action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  helps = {c.dest: c.help for c in action._choices_actions}
  return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}


def cli_reference() -> str:
  """The README's CLI section body, generated from the parser (tests/test_readme.py keeps them equal;
  `python scripts/update_readme_cli.py` rewrites it)."""
  lines = []
  for name, (sub, help_text) in subcommands(build_parser()).items():
    usage = " ".join(sub.format_usage().split()).removeprefix("usage: ").replace(" [-h]", "")
    lines.append(f"- `{usage}`  \n  {help_text}")
  return "\n".join(lines) + "\n"


def _exit_on_interrupt(command: str):
  """A SIGINT handler that says one line and leaves at once. Not a KeyboardInterrupt: raised inside jax it could
  be swallowed (the run went on) or unwind into a half-torn-down XLA (segfaults at exit). Every file a command
  writes is written whole (a temporary file renamed into place) or, the suite's records, read back tolerantly."""
  def handler(signum, frame):
    os.write(2, f"\nlongspec {command}: interrupted\n".encode())
    os._exit(INTERRUPTED)
  return handler


def main(argv: list[str] | None = None) -> int:
  """Exit codes: 0 success; 2 bad flags or inputs (argparse's convention, used for every validation error); 130
  interrupted (Ctrl-C)."""
  # transformers (imported for its tokenizer class) advises installing torch, which nothing here needs.
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  args = build_parser().parse_args(argv)
  try:
    previous = signal.signal(signal.SIGINT, _exit_on_interrupt(args.command))
  except ValueError:  # not the main thread (main() called from a worker thread): leave signals alone
    previous = None
  try:
    flags = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed or any(f is not None for f in flags):
      from longspec_jax.distributed import initialize
      initialize(*flags)
    return args.fn(args)
  except (ValueError, OSError) as e:
    # An OSError raised by the OS (not by our checks) carries strerror/filename: say it in words, without
    # "[Errno N]".
    msg = str(e)
    if isinstance(e, OSError) and e.strerror:
      msg = e.strerror.lower() + (f": {e.filename}" if e.filename else "")
    print(f"longspec {args.command}: error: {msg}", file=sys.stderr)
    return 2
  finally:
    if previous is not None:
      signal.signal(signal.SIGINT, previous)
