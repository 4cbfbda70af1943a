"""Checks for a machine with an accelerator. gpu.py needs only torch and NCCL (no install:
`PYTHONPATH=python python -m sglang_farskip.checks.gpu`); device.py starts real SGLang servers
and reuses gpu.py's side-stream memory and priority items."""
