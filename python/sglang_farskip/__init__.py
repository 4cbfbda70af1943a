"""FarSkip-Collective MoE models (DeepSeek-V3, Instella-MoE) served by SGLang 0.5.23.

The folders are the layers (README.md, "Layout", has a line per module):

    the model        config.py, options.py, checkpoint.py   what a checkpoint and the launcher say
                     schedule.py      the FarSkip lane loop, written once (SGLang-free)
                     reference.py     the executable spec, plain PyTorch
                     comm.py, nccl.py, profiler.py   every collective, as handles
                     formats/         weight formats: DeepSeek's block FP8, the requantizer
                     parallel.py      FarSkip's parallel set-up inside SGLang
                     models/          the SGLang model classes: upstream's layers, the schedule
    serving          serve/           launcher, plugin, refusals, status, redaction, timeouts, watchdog
    SGLang on CPU    cpu/             environment and fixes, attention paths
    tools            tools/           demo checkpoints, convert, patches
                     plan/            the planner (python -m sglang_farskip.plan): shapes, collectives,
                                      replay, memory, its PD view
                     fcsd/            the self-distillation (python -m sglang_farskip.fcsd)
    running things   checks/          the bare GPU check (torch only) and the device check
                     testbed/         ports, servers, network namespaces (tests/ and bench/)
                     loadtest/        the load harness's library (bench/run_load.py)

`python -m sglang_farskip.launch_server` is the launcher's public name.
"""

SGLANG_VERSION = "0.5.23"
__version__ = "0.1.0"
