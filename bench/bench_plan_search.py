"""Times the planner's 4096-GPU layout search for GPT-3 175B and prints the top layouts (not a test).

python bench/bench_plan_search.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.entry import EntryParser  # noqa: E402
from hpctrain.models import registry  # noqa: E402
from hpctrain.models.family import Dims  # noqa: E402
from hpctrain.plan.search import evaluate, explain, rank_of, search_layouts  # noqa: E402
from hpctrain.plan.step_time import step_range  # noqa: E402
from hpctrain.plan.types import Layout, ModelShape, hardware  # noqa: E402

EntryParser(description=__doc__).parse_args()  # --help says what this is; it takes no options

GPT3_175B = Dims(
    n_layers=96, d_model=12288, n_heads=96, kv_heads=96, ffn_hidden=4 * 12288, vocab_size=50257, context=2048
)
model = ModelShape(registry.get("gpt"), GPT3_175B, seq_len=2048, vocab_pad_multiple=64)
hw = hardware("a100_80gb")
start = time.perf_counter()
cands = search_layouts(model, 4096, hw, global_batch=3072)
elapsed = time.perf_counter() - start
print(f"search: {len(cands)} fitting layouts in {elapsed:.3f} s (budget 2 s)")
for c in cands[:5]:
    print(" ", c.why)
article = Layout(
    dp=64,
    tp=8,
    pp=8,
    zero_stage=3,
    micro_batch=4,
    grad_accum=12,
    sequence_parallel=True,
    recompute="full",
    reduce_dtype="fp32",
)  # as conf/experiment/175b.yaml (bf16 preset)
print(f"\narticle layout ranks {rank_of(article, cands, model, hw)} of {len(cands)}:")
print(explain(evaluate(model, article, hw), cands[0]))
span = step_range(model, article, hw)
print(
    f"\narticle layout over the estimate's assumptions: {span.slowest.samples_per_s:.1f}-"
    f"{span.fastest.samples_per_s:.1f} samples/s (point {span.point.samples_per_s:.1f}; the article reports 120)"
)
