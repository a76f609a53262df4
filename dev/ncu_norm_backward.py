"""Question: what bounds the rms_norm / layer_norm backward at 8192 x 2048 bf16 on the hardware counters? Calls for
Nsight Compute: both backwards and the rms_norm forward at 1024 and 8192 rows of 2048 (bf16), each 3 times, so
``ncu -k regex:... --launch-skip`` can read one warm launch of each. GPU only.

Answer (2026-11-30, one H200): the rms backward issued 19.45 M warp instructions (37 an element), IPC 0.61 a
scheduler, occupancy 46 %, stalls spread over short scoreboard 2.3 / long scoreboard 2.2 / not selected 2.2 per
issue. Cutting the instructions to 16.80 M left the time unchanged (34.6-34.9 us under ncu): not issue-bound; at 1024
rows 11.2 us for 12.6 MB with SMs active 79 % of the cycles. The ~10 us a call is a chain of latencies
(benchmarks/NOTES.md, "rms_norm and layer_norm backward").

    M=gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg,dram__bytes_read.sum,\
dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,\
smsp__inst_executed.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,...
    ncu --clock-control none -k regex:"bwdp|rms_fwd_bf16|finalize" --csv --page raw --metrics $M \
        python dev/ncu_norm_backward.py > ncu.csv
"""
import cupy as cp

import cukernels as ck

for N in (1024, 8192):
    x = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    dy = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    w = cp.random.standard_normal(2048, dtype=cp.float32)
    b = cp.random.standard_normal(2048, dtype=cp.float32)
    _, r = ck.rms_norm(x, w, return_rstd=True)
    _, m, s = ck.layer_norm(x, w, b, return_stats=True)
    out = cp.empty_like(x)
    for _ in range(3):
        ck.rms_norm_backward(dy, x, w, r, out=out)
    for _ in range(3):
        ck.layer_norm_backward(dy, x, w, m, s, out=out)
    for _ in range(3):
        ck.rms_norm(x, w, out=out)
    cp.cuda.Device().synchronize()
