"""Weight formats: what a checkpoint's tensors are stored as, and the tools that write them.

    fp8.py        DeepSeek's block-FP8 format, the one place that says what it is: which
                  tensors, quantize, dequantize, a config's weight format
    quantize.py   bf16 -> block-FP8 checkpoints (python -m sglang_farskip.formats.quantize)
"""
