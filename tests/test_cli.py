"""The `longspec` CLI on a tiny model directory made here (flags and JSON keys are a contract)."""

import json

import pytest

from longspec_jax.inference.cli import main
from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.hf_io import save_model_dir
from longspec_jax.model import create_model
from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe

TEXT = "".join(f"def function_{i}(x, y):\n    return x * {i} + y - {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("model")
  tok = train_bpe([TEXT], vocab_size=320)
  cfg = ModelConfig(family="qwen3", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                    rope=RopeConfig(), bos_token_id=0, eos_token_id=0, pad_token_id=1, mask_token_id=2)
  save_model_dir(create_model(cfg, seed=0), d)
  save_hf_tokenizer(tok, d)
  (d.parent / "text.txt").write_text(TEXT)
  return d


def test_generate_json_contract(model_dir, tmp_path, capsys):
  out = tmp_path / "g.json"
  assert main(["generate", "--model", str(model_dir), "--prompt", "def function_3(x, y):", "--max-new-tokens",
               "12", "--stats", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  for key in ("prompt_tokens", "output_tokens", "text", "prefill_ms", "decode_tokens_per_s"):
    assert key in res
  assert len(res["output_tokens"]) == 12 and res["prefill_ms"] > 0 and res["decode_tokens_per_s"] > 0
  captured = capsys.readouterr()
  assert res["text"] in captured.out
  assert "loading the target" in captured.err and "compiling (or loading from the cache)" in captured.err
  assert main(["generate", "--model", str(model_dir), "--prompt", "def f", "--max-new-tokens", "3",
               "--max-prompt-tokens", "2", "--quiet", "--json", str(out)]) == 0
  assert capsys.readouterr().err == "" and len(json.loads(out.read_text())["prompt_tokens"]) == 2


def test_generate_speculative_compare_ar(model_dir, tmp_path, capsys):
  out = tmp_path / "spec.json"
  assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[:400], "--max-new-tokens", "24",
               "--method", "prompt-lookup", "--num-draft", "4", "--compare-ar", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["method"] == "prompt-lookup" and res["num_draft_tokens"] == 4
  assert res["exact_match_ar"] is True and len(res["output_tokens"]) == 24
  assert res["ar_tokens_per_s"] > 0 and res["tokens_per_s"] > 0
  assert res["speedup"] == pytest.approx(res["tokens_per_s"] / res["ar_tokens_per_s"])
  assert 1.0 <= res["tau"] <= 5.0
  captured = capsys.readouterr()
  assert res["text"] in captured.out  # streamed
  assert "speedup" in captured.err and "tokens equal to AR's" in captured.err


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "5"], "with --temperature 0 (greedy) they would be ignored"),
    (["--top-p", "0.5"], "with --temperature 0 (greedy) they would be ignored"),
    (["--num-draft", "4"], "--num-draft applies to speculative methods"),
    (["--method", "prompt-lookup", "--budget", "64"], "--budget applies to budget"),
    (["--method", "eagle3", "--learned", "dflash"], "--learned applies to hybrid"),
    (["--method", "prompt-lookup", "--sharpdraft", "fixed"], "has none"),
    (["--compare-ar"], "--method ar is AR already"),
    (["--draft-length", "auto"], "--draft-length applies to speculative methods"),
    (["--method", "prompt-lookup", "--draft-length", "nope.json"], "draft-length rule nope.json not found"),
])
def test_generate_refuses_flags_the_mode_ignores(model_dir, capsys, flags, message):
  assert main(["generate", "--model", str(model_dir), "--prompt", "def f", *flags]) == 2
  err = capsys.readouterr().err
  assert message in err and "loading the target" not in err  # refused before the model loads


def test_calibrate_draft_length_then_generate_with_it(model_dir, tmp_path, capsys):
  """calibrate-draft-length writes a rule with one measured cost per size; generate and bench run with it (and
  with auto), tokens equal to AR's, and report the share of steps at each size."""
  prompt = tmp_path / "held_out.py"
  prompt.write_text(TEXT[:3000])
  rule = tmp_path / "rule.json"
  assert main(["calibrate-draft-length", "--model", str(model_dir), "--method", "prompt-lookup", "--prompt-file",
               str(prompt), "--max-prompt-tokens", "300", "--num-draft", "4", "--steps", "2", "--repeats", "1",
               "--new-tokens", "40", "--prior-prompts", "3", "--out", str(rule), "--quiet"]) == 0
  saved = json.loads(rule.read_text())
  ends = saved["measured"]["prior_prompt_ends"]  # three 300-token windows spread over the file
  assert len(ends) == 3 and ends[0] == 299 and ends == sorted(set(ends))  # in the text's tokens; BOS first
  assert saved["rule"]["sizes"] == [0, 1, 3, 4] and len(saved["rule"]["costs"]) == 4
  # priors: (first, next) acceptance per draft class (prompt lookup: matched n-gram length 0-3) at K every step
  priors, observed = saved["rule"]["prior_rates"], saved["measured"]["observed_rates_per_class"]
  assert len(priors) == 4 and all(0 <= x <= 1 for row in priors for x in row)
  assert any(x is not None for row in observed for x in row)
  assert min(saved["rule"]["costs"]) > 0 and saved["measured"]["prompt_tokens"] == 300
  for choice in (str(rule), "auto"):
    out = tmp_path / "g.json"
    assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[:400], "--max-new-tokens", "24",
                 "--method", "prompt-lookup", "--num-draft", "4", "--draft-length", choice, "--compare-ar", "--quiet",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["exact_match_ar"] is True and res["draft_sizes"] == [0, 1, 3, 4]
    assert sum(res["size_share"]) == pytest.approx(1.0, abs=1e-3) and res["rows_per_step"] >= 1.0
  bench = tmp_path / "b.json"
  assert main(["bench", "--model", str(model_dir), "--method", "prompt-lookup", "--text-file",
               str(model_dir.parent / "text.txt"), "--context", "200", "--new-tokens", "16", "--repeats", "1",
               "--draft-length", "auto", "--quiet", "--json", str(bench)]) == 0
  res = json.loads(bench.read_text())
  assert res["exact_match_ar"] is True and res["draft_length"]["sizes"] == [0, 1, 3, 8] and "size_share" in res
  with pytest.raises(SystemExit) as e:
    main(["calibrate-draft-length", "--model", str(model_dir), "--method", "ar", "--prompt-file", str(prompt),
          "--out", str(rule)])
  assert e.value.code == 2 and "invalid choice: 'ar'" in capsys.readouterr().err


def test_calibrate_draft_length_costs_per_context(model_dir, tmp_path, capsys):
  """--cost-contexts times the costs at each prompt length: one row per cache length, which generate resolves at
  its own cache length; lengths out of order or past the file are refused before anything is timed."""
  prompt = tmp_path / "held_out.py"
  prompt.write_text(TEXT[:3000])
  rule = tmp_path / "rule.json"
  args = ["calibrate-draft-length", "--model", str(model_dir), "--method", "prompt-lookup", "--prompt-file",
          str(prompt), "--max-prompt-tokens", "100", "--num-draft", "2", "--steps", "2", "--repeats", "1",
          "--new-tokens", "4", "--prior-prompts", "1", "--out", str(rule), "--quiet"]
  assert main([*args, "--cost-contexts", "60,300"]) == 0
  saved = json.loads(rule.read_text())["rule"]
  assert saved["sizes"] == [0, 1, 2] and len(saved["costs"]) == 2 and all(len(r) == 3 for r in saved["costs"])
  assert saved["cost_contexts"][0] < saved["cost_contexts"][1] and min(min(r) for r in saved["costs"]) > 0
  out = tmp_path / "g.json"
  assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[:400], "--max-new-tokens", "12", "--method",
               "prompt-lookup", "--num-draft", "2", "--draft-length", str(rule), "--compare-ar", "--quiet", "--json",
               str(out)]) == 0
  assert json.loads(out.read_text())["exact_match_ar"] is True
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    main([*args, "--cost-contexts", "300,60"])
  assert e.value.code == 2 and "must be ascending distinct positive integers" in capsys.readouterr().err
  assert main([*args, "--cost-contexts", "60,100000"]) == 2
  assert "--cost-contexts 100000 is longer than" in capsys.readouterr().err


def test_generate_binary_prompt_file(model_dir, tmp_path, capsys):
  binary = tmp_path / "blob.bin"
  binary.write_bytes(bytes(range(256)) * 4)
  assert main(["generate", "--model", str(model_dir), "--prompt-file", str(binary)]) == 2
  assert f"prompt file {binary} is not UTF-8 text" in capsys.readouterr().err


def test_compile_cache_second_run_compiles_nothing(model_dir, tmp_path):
  """Two processes, one cache directory: the second loads every program instead of compiling it."""
  import os
  import subprocess
  import sys
  runs = []
  for i in range(2):
    out = tmp_path / f"run{i}.json"
    subprocess.run([sys.executable, "-m", "longspec_jax.inference.cli", "generate", "--model", str(model_dir),
                    "--prompt", "def f", "--max-new-tokens", "8", "--method", "prompt-lookup", "--quiet",
                    "--compile-cache", str(tmp_path / "cache"), "--json", str(out)],
                   check=True, env={**os.environ, "LONGSPEC_COMPILE_CACHE": "off"}, capture_output=True)
    runs.append(json.loads(out.read_text()))
  assert runs[0]["programs_compiled"] >= 2
  assert runs[1]["programs_compiled"] == 0 and runs[1]["programs_from_cache"] >= 2
  assert runs[1]["output_tokens"] == runs[0]["output_tokens"]
  assert any((tmp_path / "cache").iterdir())


def test_compile_cache_dir_choice(tmp_path, monkeypatch):
  from longspec_jax.compile_cache import compile_cache_dir
  monkeypatch.setenv("LONGSPEC_COMPILE_CACHE", str(tmp_path / "env"))
  assert compile_cache_dir() == tmp_path / "env"
  assert compile_cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"  # the flag wins
  assert compile_cache_dir("off") is None
  monkeypatch.delenv("LONGSPEC_COMPILE_CACHE")
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "targets"))
  assert compile_cache_dir() == tmp_path / "targets" / "jax_cache"


def test_generate_errors(model_dir, capsys):
  assert main(["generate", "--model", str(model_dir), "--prompt", ""]) == 2
  assert "longspec generate: error: the prompt is empty" in capsys.readouterr().err
  assert main(["generate", "--model", str(model_dir)]) == 2
  assert "exactly one" in capsys.readouterr().err
  assert main(["generate", "--model", str(model_dir / "missing"), "--prompt", "x"]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_export_and_eval(model_dir, tmp_path):
  assert main(["export-hf", "--model", str(model_dir), "--out", str(tmp_path / "exp")]) == 0
  assert (tmp_path / "exp" / "config.json").exists() and (tmp_path / "exp" / "tokenizer.json").exists()
  out = tmp_path / "e.json"
  assert main(["eval-target", "--model", str(model_dir), "--text-file", str(model_dir.parent / "text.txt"),
               "--max-len", "2048", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert set(["0-1K", "1-2K", "2-4K", "4-8K", "8-16K", "unigram"]) <= set(res)
  assert res["0-1K"] > 0 and res["1-2K"] > 0 and res["2-4K"] is None  # text cut at 2048 tokens


def test_bench_json_contract(model_dir, tmp_path, capsys):
  out = tmp_path / "b.json"
  assert main(["bench", "--method", "prompt-lookup", "--text-file", str(model_dir.parent / "text.txt"),
               "--context", "200", "--new-tokens", "16", "--model", str(model_dir), "--repeats", "1",
               "--num-draft", "4", "--json", str(out)]) == 0
  err = capsys.readouterr().err  # progress: phase, prompt and method
  for phase in ("loading the target", "prompt: first 200 tokens", "ar: compiling", "prompt-lookup: compiling",
                "timing one draft and one verify step"):
    assert phase in err, (phase, err)
  res = json.loads(out.read_text())
  for key in ("method", "context", "new_tokens", "batch", "temperature", "tau", "accept_per_position",
              "target_forwards", "tokens_per_s", "ar_tokens_per_s", "speedup", "draft_ms_per_step",
              "verify_ms_per_step", "drafter_state_bytes", "peak_rss_bytes", "exact_match_ar"):
    assert key in res, key
  assert res["exact_match_ar"] is True and res["tau"] >= 1 and len(res["accept_per_position"]) == 4
  assert res["verify_over_decode"] == pytest.approx(res["verify_ms_per_step"] * res["ar_tokens_per_s"] / 1000)
  with pytest.raises(SystemExit) as e:
    main(["bench", "--method", "nope", "--text-file", str(model_dir.parent / "text.txt"), "--context", "10",
          "--model", str(model_dir)])
  assert e.value.code == 2


def test_bench_with_transformers_peers(model_dir, tmp_path):
  pytest.importorskip("torch")
  out = tmp_path / "p.json"
  # The tiny model doubles as its own standalone drafter: every draft is accepted.
  assert main(["bench", "--method", "standalone", "--text-file", str(model_dir.parent / "text.txt"),
               "--context", "100", "--new-tokens", "12", "--model", str(model_dir), "--drafter", str(model_dir),
               "--repeats", "1", "--num-draft", "3", "--peer", "transformers", "--json", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["exact_match_ar"] is True and res["accept_per_position"] == [1.0, 1.0, 1.0]
  peers = res["peer_tokens_per_s"]
  assert set(peers) == {"transformers-ar", "transformers-assisted", "transformers-prompt-lookup"}
  assert all(v > 0 for v in peers.values())


def test_bench_peer_skips_a_drafter_of_another_vocabulary(model_dir, tmp_path):
  """The shipped PARD drafter (vocab 8192) cannot assist a 320-token target: the peer run says so instead of
  failing after the other peers ran."""
  pytest.importorskip("torch")
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
  out = tmp_path / "p.json"
  assert main(["bench", "--method", "ar", "--text-file", str(model_dir.parent / "text.txt"), "--context", "100",
               "--new-tokens", "6", "--model", str(model_dir), "--drafter", str(SHIPPED_DRAFTERS_DIR / "pard"),
               "--repeats", "1", "--peer", "transformers", "--json", str(out)]) == 0
  assert set(json.loads(out.read_text())["peer_tokens_per_s"]) == {"transformers-ar", "transformers-prompt-lookup"}


# --- The first five minutes (issue 57, item 8): what a newcomer met, each now one clear line or a fair figure -------

def _cli(*args, env=None, timeout=120):
  import os
  import subprocess
  import sys
  return subprocess.run([sys.executable, "-m", "longspec_jax.inference.cli", *args], capture_output=True, text=True,
                        timeout=timeout, env={**os.environ, **(env or {})})


def test_compare_ar_times_method_and_ar_alike(model_dir, monkeypatch, capsys):
  """The text streams from a warm-up run; then the method and AR are timed alternately, neither streamed (the
  method used to be timed on its first, streaming run and AR on quiet ones)."""
  from longspec_jax.inference import engine
  calls, real_run = [], engine.run

  def recording_run(config, params, inputs, on_steps=None, **kw):
    calls.append(("ar" if config.drafter is None else "method", on_steps is not None))
    return real_run(config, params, inputs, on_steps=on_steps, **kw)

  monkeypatch.setattr(engine, "run", recording_run)
  args = ["generate", "--model", str(model_dir), "--prompt", TEXT[:300], "--max-new-tokens", "12", "--method",
          "prompt-lookup", "--num-draft", "4"]
  assert main([*args, "--compare-ar", "--repeats", "2"]) == 0
  assert calls == [("method", True), ("ar", False), ("method", False), ("ar", False), ("method", False),
                   ("ar", False)]
  calls.clear()
  assert main(args) == 0  # alone: the streamed run is the one timed
  assert calls == [("method", True)]
  assert capsys.readouterr().out.count("function") == 24  # 12 tokens streamed by each call


@pytest.mark.parametrize("stage", ["compiling", "generating"])
def test_ctrl_c_ends_with_one_line_and_130(model_dir, tmp_path, stage):
  import signal
  import subprocess
  import sys
  out = tmp_path / "g.json"
  proc = subprocess.Popen([sys.executable, "-m", "longspec_jax.inference.cli", "generate", "--model", str(model_dir),
                           "--prompt", TEXT[:200], "--max-new-tokens", "3500", "--method", "prompt-lookup",
                           "--compare-ar", "--repeats", "5", "--compile-cache", "off", "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  seen = []
  for line in proc.stderr:  # progress lines: interrupt once the stage has begun
    seen.append(line)
    if stage in line:
      break
  proc.send_signal(signal.SIGINT)
  _, rest = proc.communicate(timeout=120)
  err = "".join(seen) + rest
  assert proc.returncode == 130, err
  assert err.rstrip().splitlines()[-1] == "longspec generate: interrupted", err
  assert "Traceback" not in err and not out.exists()


def test_bench_suite_ctrl_c_ends_with_130(model_dir, tmp_path):
  """The suite used to swallow an interrupt now and then and run on to rc 0."""
  import signal
  import subprocess
  import sys
  config = tmp_path / "suite.yaml"
  config.write_text(f"model: {model_dir}\nmethods: [prompt-lookup]\ncontexts: [64]\nnum_prompts: 8\nmin_docs: 1\n"
                    f"docs: [{model_dir.parent / 'text.txt'}]\ncut_min_tokens: 64\nnew_tokens: 2000\nbootstrap: 100\n")
  proc = subprocess.Popen([sys.executable, "-m", "longspec_jax.inference.cli", "bench-suite", "--config",
                           str(config), "--out", str(tmp_path / "out")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  import time
  deadline = time.time() + 90
  while not (tmp_path / "out").exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  time.sleep(2)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert err.rstrip().splitlines()[-1] == "longspec bench-suite: interrupted" and "Traceback" not in err


def test_output_files_are_checked_before_any_work(model_dir, tmp_path, capsys):
  (tmp_path / "a_dir").mkdir()
  (tmp_path / "a_file").write_text("")
  for path, message in ((tmp_path / "a_dir", "is a directory, not a file"),
                        (tmp_path / "a_file" / "out.json",
                         f"cannot be written: {tmp_path / 'a_file'} is a file, not a folder")):
    for cmd in (["generate", "--prompt", "def f"],
                ["bench", "--method", "ar", "--text-file", str(model_dir.parent / "text.txt"), "--context", "32"],
                ["eval-target", "--text-file", str(model_dir.parent / "text.txt")]):
      assert main([cmd[0], "--model", str(model_dir), *cmd[1:], "--json", str(path)]) == 2
      err = capsys.readouterr().err
      assert f"--json {path} {message}" in err and "loading the target" not in err, err


def test_compile_cache_that_is_a_file(model_dir, tmp_path, capsys, monkeypatch):
  blocker = tmp_path / "cache_file"
  blocker.write_text("")
  assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--compile-cache", str(blocker)]) == 2
  err = capsys.readouterr().err
  assert f"compiled-program cache {blocker} (from --compile-cache) is a file, not a directory" in err
  monkeypatch.setenv("LONGSPEC_COMPILE_CACHE", str(blocker))
  assert main(["generate", "--model", str(model_dir), "--prompt", "x"]) == 2
  assert "(from $LONGSPEC_COMPILE_CACHE) is a file" in capsys.readouterr().err


def test_num_draft_is_bounded(model_dir, capsys):
  r = _cli("generate", "--model", str(model_dir), "--prompt", "x", "--method", "prompt-lookup", "--num-draft", "1000")
  assert r.returncode == 2 and "--num-draft: must be in 1..64, got 1000" in r.stderr
  from longspec_jax import generate, load_drafter
  from longspec_jax.hf_io import load_model_dir
  model = load_model_dir(model_dir)
  with pytest.raises(ValueError, match=r"num_draft must be in 1\.\.64"):
    generate(model, [[3, 4, 5]], max_new_tokens=4, drafter=load_drafter("prompt-lookup", model), num_draft=65)


def test_draft_length_rule_of_another_target_or_dtype(model_dir, tmp_path, capsys):
  rule = tmp_path / "rule.json"
  base = ["generate", "--model", str(model_dir), "--prompt", "def f", "--method", "prompt-lookup", "--draft-length",
          str(rule)]
  rule.write_text(json.dumps({"rule": {}, "measured": {"model": "smollm2-135m", "dtype": "float32"}}))
  assert main(base) == 2
  err = capsys.readouterr().err
  assert f"draft-length rule {rule} was calibrated for target smollm2-135m (float32), not this run's" in err
  assert "calibrate-draft-length" in err
  rule.write_text(json.dumps({"rule": {}, "measured": {"model": str(model_dir), "dtype": "int8-weights"}}))
  assert main(base) == 2
  assert "(int8-weights), not this run's" in capsys.readouterr().err


def test_seed_is_refused_under_greedy(model_dir, capsys):
  assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--seed", "3"]) == 2
  assert "--seed seeds sampling; with --temperature 0 (greedy) it would be ignored" in capsys.readouterr().err
  assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--seed", "3", "--temperature", "0.7",
               "--max-new-tokens", "2", "--quiet"]) == 0


def test_another_methods_checkpoint_is_named():
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, load_drafter
  with pytest.raises(ValueError, match=r"is a DFlashDraftModel checkpoint \(method dels, dflash, dflash-budget\), "
                                       r"not one for method eagle3 \(LlamaForCausalLMEagle3 or "):
    load_drafter("eagle3", None, SHIPPED_DRAFTERS_DIR / "dflash")
  with pytest.raises(ValueError, match="is a LlamaForCausalLMEagle3 checkpoint .* not one for method dflash"):
    load_drafter("hybrid", None, SHIPPED_DRAFTERS_DIR / "eagle3", learned="dflash")


def test_prompt_cut_is_said(model_dir, capsys):
  assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[:200], "--max-prompt-tokens", "5",
               "--max-new-tokens", "2"]) == 0
  err = capsys.readouterr().err
  assert "prompt cut by --max-prompt-tokens: its first 5 of " in err and "tokens kept" in err


def test_export_hf_refuses_a_non_empty_directory(model_dir, tmp_path, capsys):
  out = tmp_path / "exp"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  assert main(["export-hf", "--model", str(model_dir), "--out", str(out)]) == 2
  assert f"--out {out} exists and is not an empty directory" in capsys.readouterr().err
  assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_flag_errors_are_one_line():
  for args, msg in ((["generate", "--bogus"], "unrecognized arguments: --bogus"),
                    (["generate", "--prompt", "x", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
                    (["bench", "--method", "ar"], "the following arguments are required")):
    r = _cli(*args, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_no_torch_advice_on_a_machine_without_torch(model_dir):
  """transformers (imported for its tokenizer class) advises installing torch; nothing here needs it. Simulated:
  torch hidden from transformers' package check."""
  import subprocess
  import sys
  code = ("import importlib.util, sys; real = importlib.util.find_spec; "
          "importlib.util.find_spec = lambda n, *a, **k: None if n == 'torch' else real(n, *a, **k); "
          "from longspec_jax.inference.cli import main; "
          f"sys.exit(main(['generate', '--model', {str(model_dir)!r}, '--prompt', 'x', '--max-new-tokens', '2']))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "PyTorch" not in r.stderr, r.stderr


def test_int8_weights_help_states_the_measured_gain():
  r = _cli("generate", "--help", timeout=60)
  assert "several times faster" not in r.stdout and "~24% faster" in " ".join(r.stdout.split())
