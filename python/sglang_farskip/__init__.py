"""FarSkip-Collective MoE models (DeepSeek-V3, Instella-MoE) served by SGLang 0.5.23.

What lives where (README.md, "Layout", has a line per module). Which of these may import
which is written once, as the layers contract in pyproject.toml [tool.importlinter],
lowest last; tests/test_layers.py enforces it.

    the model        config.py, options.py, checkpoint.py   what a checkpoint and the launcher say
                     schedule.py      the FarSkip lane loop, written once (SGLang-free)
                     reference.py     the executable spec, plain PyTorch
                     comm.py, nccl.py, profiler.py   every collective, as handles
                     formats/         weight formats: DeepSeek's block FP8, the requantizer
                     boundary/        every place the project touches SGLang, one table; its
                                      installer and the upgrade check (python -m sglang_farskip.boundary check)
                     parallel.py      FarSkip's parallel set-up inside SGLang, and what it refuses
                     models/          the SGLang model classes: upstream's layers, the schedule;
                                      each rank's status report
    serving          serve/           launcher, plugin, admission, admin, redaction, timeouts, KV transfer,
                                      watchdog
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
