"""The benchmark code behind `longspec bench` and `longspec bench-suite`.

- `config`: the suite's YAML schema and its method strings (`NAME:key=value,...`, checked against the drafter
  registry).
- `prompts`: prompts from text: cut points in held-out documents (the suite), a file's first tokens (`bench`).
- `measure`: timing on the engine's public steps: one shared target prefill per prompt, each method's start state
  and decode loop, one draft pass and one verify pass timed apart.
- `statistics`: bootstrap confidence intervals, paired differences, per-cell summaries.
- `provenance`: what a result depends on and where it ran (target and drafter hashes, git, machine, load).
- `report`: results.json, results.md and the (optional) plots.
- `suite`: the sweep itself, resumable from per-prompt records on disk.
- `peers`: `transformers` on the same weights (AR, assisted generation, prompt lookup).
- `llamacpp`: llama.cpp on the GGUF a named target comes from (AR, prompt lookup), in a child process.

Importing the package imports nothing heavy: each command imports the modules it runs.
"""
