"""Registration with SGLang: entry point `sglang.srt.plugins` -> `register()`.

SGLang calls `register()` in every process it starts (HTTP server, each scheduler/TP worker,
detokenizer), because spawned workers inherit none of a launcher's in-memory changes. It
1. applies the CPU fixes when SGLang runs on CPU (see cpu_support.py);
2. puts the FarSkip class in SGLang's model registry under "DeepseekV3ForCausalLM".

The class is upstream's whenever config.json says `"farskip": false`, so plain DeepSeek-V3
checkpoints are served exactly as stock SGLang serves them.

SGLang logs and swallows any exception raised here; `registered_class()` lets the launcher
check that registration really happened.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_farskip.plugin")

ARCHITECTURE = "DeepseekV3ForCausalLM"


def register_cpu_support() -> None:
    """Entry point `farskip_cpu`: only the CPU fixes (also what stock-SGLang A/B runs use)."""
    from sglang_farskip.cpu_support import apply_cpu_fixes, is_cpu_run

    if is_cpu_run():
        apply_cpu_fixes()


def register() -> None:
    """Entry point `farskip`: the CPU fixes and the FarSkip model class."""
    from sglang.srt.models.registry import ModelRegistry

    from sglang_farskip.models.deepseek_v3 import FarSkipDeepseekV3ForCausalLM

    register_cpu_support()
    ModelRegistry.models[ARCHITECTURE] = FarSkipDeepseekV3ForCausalLM
    logger.info("sglang_farskip: %s -> %s", ARCHITECTURE, FarSkipDeepseekV3ForCausalLM.__qualname__)


def registered_class():
    """The class SGLang will build for DeepSeek-V3 checkpoints in this process."""
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls([ARCHITECTURE])
    return cls
