"""FCSD (FarSkip-Collective Self-Distillation, arXiv 2511.11505 sections 2.2 and 5.1): turn a
DeepSeek-V3 checkpoint into a FarSkip one that this project serves.

    python -m sglang_farskip.fcsd TEACHER_DIR DATA OUT_DIR [--start-layer N --end-layer M |
                                  --attn-only | --mlp-only] [--tokens N] [--lr X] ...
    torchrun --nproc-per-node 8 -m sglang_farskip.fcsd ...        (PyTorch FSDP2)

The student is the teacher's checkpoint with FarSkip wiring (student.py), every parameter
trained; the teacher is the same checkpoint, frozen, run on the fly; the loss is token-level
forward KL(teacher || student) at temperature 1 (loss.py). See `--help` and docs/fcsd.md "Converting
a model".
"""
