python scripts/seeds_report.py --results results/bench_suite/smollm2_seeds_t1 results/bench_suite/smollm2_seeds_t1_4k results/bench_suite/smollm2_seeds_t1_8k results/bench_suite/smollm2_seeds_t1_16k \
  --out results/seeds_smollm2_t1 \
  --label "dflash:num_draft=15=DFlash" --label "dflash:num_draft=15,sharpdraft=exact=DFlash+SharpDraft" \
  --label "dels:num_draft=15=DeLS" --label "longspark:num_draft=7=LongSpark" \
  --label "longspark-dels:num_draft=7=LongSpark+DeLS" --label "combined:num_draft=7=combined" \
  --pair "DFlash+SharpDraft|DFlash" --pair "LongSpark|DFlash" --pair "DeLS|DFlash" \
  --pair "LongSpark+DeLS|LongSpark" --pair "combined|LongSpark" --pair "combined|LongSpark+DeLS" \
  --pair "combined|DeLS" --pair "combined|DFlash+SharpDraft" \
  --recovery "DFlash|DFlash+SharpDraft" --ratio LongSpark --ratio combined --ref-context 1024
