"""FarSkip-Collective DeepSeek-V3 for SGLang 0.5.23.

Modules: config (the one validated FarSkip config), reference (plain-PyTorch executable spec),
models/ (the SGLang model class), plugin (registration in every SGLang process), comm (every
collective), launch_server, demo_model, convert.
"""

SGLANG_VERSION = "0.5.23"
__version__ = "0.1.0"
