"""Registration with SGLang: entry point `sglang.srt.plugins` -> `register()`.

SGLang calls `register()` in every process it spawns (HTTP server, each scheduler/TP worker,
detokenizer), because a spawned worker inherits none of the launcher's in-memory changes; a
forked one (on CPU, cpu/environment.py) inherits them, and SGLang does not load plugins twice. It
installs the rows of the boundary table (sglang_farskip/boundary/table.csv) for every process and,
on CPU, for CPU runs:
1. applies the CPU fixes when SGLang runs on CPU (see cpu/environment.py);
2. puts the FarSkip classes in SGLang's model registry under "DeepseekV3ForCausalLM" and
   "InstellaMoEForCausalLM";
3. hooks SGLang's model-shape derivation so that "InstellaMoEForCausalLM" gets the MLA KV-cache
   layout (SGLang recognises MLA from a hard-coded list of architecture names);
4. hooks SGLang's redaction so that the API keys never reach a log, a crash dump or an HTTP
   answer (serve/redact.py);
5. bounds the waits for peer nodes that upstream leaves unbounded or at two hours (serve/timeouts.py);
6. fixes a race that ends a PD prefill server's KV transfer thread (serve/kv_transfer.py).

The class is upstream's whenever config.json says `"farskip": false`, so plain DeepSeek-V3
checkpoints are served exactly as stock SGLang serves them.

SGLang logs and swallows any exception raised here; `missing()` lets the launcher check that
every row is really in place (and the launcher checks the KV layout SGLang derives).
"""

from __future__ import annotations

import logging
import os
import sys

from sglang_farskip import boundary
from sglang_farskip.checkpoint import DEEPSEEK_V3_ARCH, INSTELLA_ARCH
from sglang_farskip.cpu.environment import quiet_known_cpu_noise

logger = logging.getLogger("sglang_farskip.serve.plugin")

# The one thing done at import: log and warning filters (nothing else, and nothing off CPU).
# SGLang imports this module, then its own modules (which print the noise), then calls
# register(): a filter installed in register() would come too late.
quiet_known_cpu_noise()

# SGLang's MLA branch in ModelConfig._derive_model_shapes (model_config.py:1366) keys on this name.
_MLA_ALIAS = DEEPSEEK_V3_ARCH


def register_cpu_support() -> None:
    """Entry point `farskip_cpu`: only the CPU fixes (also what stock-SGLang A/B runs use)."""
    from sglang_farskip.cpu.environment import apply_cpu_fixes, is_cpu_run

    if is_cpu_run():
        apply_cpu_fixes()


def _classes() -> dict:
    from sglang_farskip.models.deepseek_v3 import FarSkipDeepseekV3ForCausalLM
    from sglang_farskip.models.instella_moe import InstellaMoEForCausalLM

    return {DEEPSEEK_V3_ARCH: FarSkipDeepseekV3ForCausalLM, INSTELLA_ARCH: InstellaMoEForCausalLM}


def derive_shapes_as_mla(original, model_config, *args, **kwargs):
    """AROUND hook: for Instella, run upstream's shape derivation as if the architecture list
    also named DeepSeek-V3, so upstream's own MLA branch sets the KV layout, head sizes and
    softmax scale; the list is restored before anything else reads it."""
    archs = model_config.hf_config.architectures
    if not archs or INSTELLA_ARCH not in archs:
        return original(model_config, *args, **kwargs)
    model_config.hf_config.architectures = [*archs, _MLA_ALIAS]
    try:
        return original(model_config, *args, **kwargs)
    finally:
        model_config.hf_config.architectures = archs


# Imported first by register(), SGLang's model registry imports each of its ~260 model modules
# (about 3-4 CPU-seconds in every SGLang process, ~10 per server start). Named as an "external
# model package", this package is imported instead, and upstream's models load only if an
# architecture not registered here is asked for (sglang/srt/models/registry.py; stock
# DeepSeek-V3 weights use our class, which is upstream's when "farskip" is false).
_MODEL_PACKAGE_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"


def defer_upstream_model_imports() -> None:
    if "sglang.srt.models.registry" not in sys.modules:
        os.environ.setdefault(_MODEL_PACKAGE_ENV, "sglang_farskip.models")


def register() -> None:
    """Entry point `farskip`: the CPU fixes and the table's "every" rows (the FarSkip model
    classes, the MLA hook, redaction, timeouts, the KV-transfer fix)."""
    defer_upstream_model_imports()
    register_cpu_support()
    boundary.install("every")
    for arch, cls in _classes().items():
        logger.info("sglang_farskip: %s -> %s", arch, cls.__qualname__)


def missing() -> list[str]:
    """The rows of the table the plugin should have put in place in this process and did not
    (SGLang logs and swallows a plugin's errors and a hook that failed to apply)."""
    from sglang_farskip.cpu.environment import is_cpu_run

    return boundary.missing("every") + (boundary.missing("cpu") if is_cpu_run() else [])
