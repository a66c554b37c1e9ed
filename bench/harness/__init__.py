"""The measuring code of bench/ (docs/benchmarks.md), one module per job:

- ``timing``    pinned threads, cache flushes, the timer (median of timed samples)
- ``costs``     bytes and FLOPs a call must move and do, and the roofline against the machine's limits
- ``routing``   what a routing asks of one rank's local experts (rows, touched experts, pairs)
- ``workload``  the scaled-down shapes (fewer local experts) and their weights
- ``checks``    correctness checks of baselines and of the op
- ``report``    records, the printed table, JSON and PNG plots
- ``cli``       the command line every script shares; the start and end of a run
- ``hosts``     the host kind's id and description, and the per-host summary `make bench` commits
- ``results_doc`` the results table of docs/benchmarks.md, rendered from the per-host summaries
- ``nki_extrapolate`` the NKI cost model's additive features of an interpreted launch, combined exactly to a full
  layer (bench_nki_gemm.py; NKI interpreter records, not timings)

Every figure a benchmark prints is a ratio measured in the same run on the same pinned thread count: against the
machine's own limits (``static_moe.testing.machine.measure_machine``; the demo measures with the same code), and
against baselines run on the same inputs in the same process (bench/baselines.py). Everything runs on the CPU, in
the calling process; tensors are torch CPU tensors.
"""
