"""End-to-end check: vLLM (CPU build) serves an EAGLE-3 drafter exported by `longspec export-drafter`.

Run with vLLM's own interpreter (vLLM is not a project dependency), once per mode, then compare:
  python serve_eagle3.py --mode ar   --target T --out ar.json
  python serve_eagle3.py --mode spec --target T --drafter D --out spec.json
  python serve_eagle3.py --compare ar.json spec.json
"""
import argparse
import json
import time

PROMPTS = [
  'The history of the city begins',
  'Once upon a time, there was a',
  'In mathematics, a prime number is',
  'The weather today is',
]


def generate(mode: str, target: str, drafter: str | None, k: int, max_tokens: int, ours: list[str], dtype: str) -> dict:
  from vllm import LLM, SamplingParams  # only in vLLM's venv

  # `longspec generate --json` files hold the prompt ids our library used (BOS first): both engines see one context
  prompts = [{'prompt_token_ids': json.load(open(f))['prompt_tokens']} for f in ours] if ours else PROMPTS

  spec = None
  if mode == 'spec':
    spec = {'method': 'eagle3', 'model': drafter, 'num_speculative_tokens': k}
  llm = LLM(model=target, speculative_config=spec, max_model_len=512, enforce_eager=True, dtype=dtype,
            max_num_seqs=4, disable_log_stats=False, seed=0)
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
  t0 = time.perf_counter()
  outs = llm.generate(prompts, params)
  seconds = time.perf_counter() - t0
  metrics = {}
  for m in llm.get_metrics():
    if m.name.startswith('vllm:spec_decode'):
      metrics[m.name] = getattr(m, 'value', None) if not hasattr(m, 'values') else list(m.values)
  return {'mode': mode, 'seconds': seconds, 'prompt_token_ids': [list(o.prompt_token_ids) for o in outs],
          'token_ids': [list(o.outputs[0].token_ids) for o in outs],
          'texts': [o.outputs[0].text for o in outs], 'spec_metrics': metrics}


def compare(ar_path: str, spec_path: str, ours: list[str]) -> None:
  ar, spec = (json.load(open(p)) for p in (ar_path, spec_path))
  for i, f in enumerate(ours):
    d = json.load(open(f))
    print(f'prompt {i}: longspec eagle3 output equals vLLM AR: {d["output_tokens"] == ar["token_ids"][i]}, '
          f'longspec tau {d["tau"]:.3f} over {d["target_forwards"]} target forwards')
  for i, (a, s) in enumerate(zip(ar['token_ids'], spec['token_ids'], strict=True)):
    first = next((j for j, (x, y) in enumerate(zip(a, s, strict=True)) if x != y), None)
    print(f'prompt {i}: {len(a)} tokens, equal={a == s}, first mismatch={first}')
  m = spec['spec_metrics']
  print('spec metrics:', json.dumps(m))
  drafts, drafted = m.get('vllm:spec_decode_num_drafts'), m.get('vllm:spec_decode_num_draft_tokens')
  accepted = m.get('vllm:spec_decode_num_accepted_tokens')
  if drafts and drafted:
    print(f'acceptance rate {accepted / drafted:.3f}, mean accepted length {1 + accepted / drafts:.3f}')


if __name__ == '__main__':
  p = argparse.ArgumentParser()
  p.add_argument('--mode', choices=['ar', 'spec'])
  p.add_argument('--target')
  p.add_argument('--drafter')
  p.add_argument('--k', type=int, default=3)
  p.add_argument('--max-tokens', type=int, default=32)
  p.add_argument('--dtype', default='bfloat16', help="vLLM's dtype for target and drafter")
  p.add_argument('--out')
  p.add_argument('--compare', nargs=2)
  p.add_argument('--ours', nargs='*', default=[], help='longspec generate --json files: their prompt ids are used')
  a = p.parse_args()
  if a.compare:
    compare(*a.compare, a.ours)
  else:
    json.dump(generate(a.mode, a.target, a.drafter, a.k, a.max_tokens, a.ours, a.dtype), open(a.out, 'w'), indent=1)
