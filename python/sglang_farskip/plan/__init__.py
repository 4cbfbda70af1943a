"""FarSkip planner: what FarSkip-Collective's overlap buys on a given cluster, before running it.

    python -m sglang_farskip.plan --model deepseek-v3 --tp 16 --decode 1,64,256 --cluster amd-good
    python -m sglang_farskip.plan --model config.json --tp 8 --prefill 2048 --batch 32 --cluster my_allreduce.txt
    python -m sglang_farskip.plan --paper
    python -m sglang_farskip.plan --list
    python -m sglang_farskip.plan --fit --model config.json
    python -m sglang_farskip.plan --pd                       (prefill/decode disaggregation: pd.py)

It predicts the step time of three runs of the same model on the same layout: `stock` (the
DeepSeek-V3 wiring, every all-reduce blocking), `sync` (the FarSkip wiring with blocking
collectives) and `overlap` (the FarSkip wiring with the asynchronous schedule of
python/sglang_farskip/schedule.py, which the served model runs), by replaying each run's sequence of kernels and
collectives on a compute stream and one FIFO communication stream.

Per-op times come from the bare GPU check's JSON (--ops) or from a roofline (--gpu, --dtype),
marked "roofline" wherever printed. Every report ends with the memory figure of memory.py: the
weights in --dtype (default the checkpoint's format) on the --tp GPUs of --gpu, and the KV cache
left; --fit asks the same of a few common layouts. docs/planner.md says what is assumed and why.

The parts, each importing only those above it:

    shapes.py        Shape: the config.json keys the cost model reads; the built-in models
    collectives.py   CommTable, LinkModel: collective time against message size; the built-in
                     tables and the nccl-tests / rccl-tests parser
    hardware.py      Gpu and the built-in GPUs; per-op times: Roofline, MeasuredOps (--ops)
    simulation.py    Layout, Phase, the programs (stock, FarSkip sync and overlap), simulate,
                     Prediction, make_plan: the replay and its notation
    memory.py        weight bytes per format and what fits on a GPU group
    report.py        a plan as text, JSON and a plot; --list, --fit and --paper's tables
    flags.py         what both command lines make of their flags (sizes, nodes, cluster, ops)
    pd.py            --pd: TTFT and ITL of prefill/decode disaggregation against colocated servers
    cli.py           the parser, run and main; __main__.py runs it
"""
