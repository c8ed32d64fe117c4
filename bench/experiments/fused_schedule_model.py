# python3 bench/experiments/fused_schedule_model.py [235b]
# Discrete-event model of the fused forward's tile order (no L2, no bandwidth): 132 CTAs,
# each one tile at a time; gemm1 tile t1 us, gemm2 tile t2 us; a gemm2 tile of block m may
# start once all n1 gemm1 tiles of m ended + drain d us. Static = round-robin by index,
# dynamic = next index to the first free CTA. Prints makespan vs staged (t1 and t2 parts
# each with its own tail) and the total wait.
import heapq, sys
def order(mb, n1, n2, G):
    units = (mb + G - 1) // G + 1
    seq = []
    for u in range(units):
        for r in range(G * n1):
            m = u * G + r // n1
            if u < units - 1 and m < mb: seq.append((0, m))
        for r in range(G * n2):
            m = (u - 1) * G + r // n2
            if u >= 1 and m < mb: seq.append((1, m))
    return seq
def run(mb, n1, n2, G, t1, t2, d, ctas, dynamic):
    seq = order(mb, n1, n2, G)
    done1 = [0] * mb; ready = [0.0] * mb; cnt = [0] * mb
    # gemm2 readiness requires knowledge of completion times: process tiles in order of
    # start; since deps are earlier in seq, compute ready times as we go (ends known).
    free = [(0.0, c) for c in range(ctas)]; heapq.heapify(free)
    cta_t = [0.0] * ctas; wait = 0.0; end = 0.0
    for i, (g, m) in enumerate(seq):
        if dynamic:
            t0, c = heapq.heappop(free)
        else:
            c = i % ctas; t0 = cta_t[c]
        start = t0
        if g == 1:
            if cnt[m] < n1: raise SystemExit("dependency not yet scheduled")
            if ready[m] > start: wait += ready[m] - start; start = ready[m]
            fin = start + t2
        else:
            fin = start + t1
            cnt[m] += 1; ready[m] = max(ready[m], fin + d)
        end = max(end, fin)
        if dynamic: heapq.heappush(free, (fin, c))
        else: cta_t[c] = fin
    return end, wait
def staged(mb, n1, n2, t1, t2, ctas):
    import math
    return math.ceil(mb * n1 / ctas) * t1 + math.ceil(mb * n2 / ctas) * t2
# Tile times from the staged kernels' measured totals (bench/NOTES.md v8/v9) over their
# tiles per CTA; d: a guess at the store warps' drain + release after a gemm1 tile.
mb, n1, n2, t1, t2, d = 1087, 6, 8, 26.9, 11.8, 3.0   # qwen3-30b-a3b, us
if len(sys.argv) > 1 and sys.argv[1] == "235b": mb, n1, n2, t1, t2 = 1083, 12, 16, 5.3e3*132/(1083*12), 2.9e3*132/(1083*16)
ctas = 132
s = staged(mb, n1, n2, t1, t2, ctas)
print(f"staged {s/1e3:.3f} ms (t1 {t1:.1f} us, t2 {t2:.1f} us)")
for waves in (0.5, 1, 2, 4, 1000):
    G = max(1, int((waves * ctas + n1 - 1) // n1)); G = min(G, mb)
    for dyn in (False, True):
        e, w = run(mb, n1, n2, G, t1, t2, d, ctas, dyn)
        print(f"G={G:5d} ({waves} waves) {'dynamic' if dyn else 'static '}: {e/1e3:.3f} ms ({100*e/s:.1f}% of staged), waits {w/1e3/ctas*1e3:.1f} us per CTA")
