# BudgetDraft on SmolLM2-135M at T = 1 (issue 31, claim (b)), 512 to 16K; run from the repository root.
python scripts/seeds_report.py --results results/bench_suite/smollm2_budget_t1_short results/bench_suite/smollm2_budget_t1 \
    results/bench_suite/smollm2_budget_t1_8k results/bench_suite/smollm2_budget_t1_16k \
  --out results/budget_smollm2_t1 \
  --label "dflash:num_draft=15,drafter=runs/dflash_smollm2_store_v1=full-v1" \
  --label "dflash:num_draft=15=full-finetune" \
  --label "dflash-budget:num_draft=15,budget=256,drafter=runs/dflash_smollm2_store_v1=naive-256" \
  --label "dflash-budget:num_draft=15,budget=256=BudgetDraft-256" \
  --pair "BudgetDraft-256|naive-256" --pair "BudgetDraft-256|full-v1" --pair "BudgetDraft-256|full-finetune" \
  --pair "naive-256|full-v1" --pair "full-finetune|full-v1" --ratio BudgetDraft-256 --ratio naive-256 --ref-context 1024
