"""Which micro-batches' activations a pipeline rank holds at its peak, chunk by chunk, for the interleaved 1F1B
schedule, whose chunks need not hold equal layers.

schedules.py counts a rank's in-flight activations in whole-stage units: Megatron's interleaved warm-up of
2(p - i - 1) + (v - 1) p chunk forwards on rank i, plus the one in flight, over v (Narayanan et al. 2021, sec. 2.2;
Korthikanti et al. 2022, sec. 4.2.3: the first stage holds p + (p - 1)/v stage-equivalents, L (1 + (p - 1)/(p v))
layers for L layers in all). That is exact when every chunk holds the same layers. With the first and the last chunk
one layer lighter (Llama 3 405B: 1 + 62 x 2 + 1 on 16 x 4 chunks, Grattafiori et al. 2024, sec. 3.3.2) the first
rank's warm-up runs its light chunk 0 once per round of p micro-batches, and more often than the others when the
warm-up spans rounds, so a rank's layers times its stage-equivalents overcounts: 127 layer-micro-batches on the first
of 16 ranks with 4 chunks and 32 micro-batches, not 7 x 19.75 = 138.25.

`held_chunks` replays the rank's order as torch 2.13 runs it (torch/distributed/pipelining/schedules.py,
`ScheduleInterleaved1F1B`: `get_rank_warmup_ops` = (v - 1) x micro-batches per round + 2 (p - 1 - rank), capped at
m v; forward op k on local chunk (k // round) % v, backward op k on v - 1 - ((k - warm-up) // round) % v;
`_get_1f1b_rank_ops`: warm-up forwards, then a forward and a backward each step, then the remaining backwards) and
returns how many micro-batches of each local chunk are held when their layers peak. Rounds hold p micro-batches
(torch needs m to be a multiple of p: schedules.py, `microbatches_multiple_of_pp`).
"""

from __future__ import annotations

from functools import cache


@cache
def held_chunks(pp: int, microbatches: int, virtual_stages: int, rank: int, layers: tuple[int, ...]) -> tuple[int, ...]:
    """Micro-batches of each of the rank's `virtual_stages` local chunks (holding `layers` layers each, first to last)
    whose activations are held when their layers together peak, under torch's interleaved 1F1B order."""
    p, m, v = pp, microbatches, virtual_stages
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    held, best, peak = [0] * v, (0,) * v, -1
    for op in range(total + warmup):
        if op < total:
            held[forward_chunk(op)] += 1
            now = sum(n * layer for n, layer in zip(held, layers, strict=True))
            if now > peak:
                best, peak = tuple(held), now
        if op >= warmup:
            held[backward_chunk(op)] -= 1
    return best
