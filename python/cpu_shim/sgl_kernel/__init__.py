"""Stand-in for `sgl_kernel` on CPU machines that have no build of it (PyPI ships none).

SGLang 0.5.23 imports a few `*_cpu` names from sgl_kernel at import time even though, on a CPU
without AMX, it never calls them. This package satisfies those imports and nothing more: every
name is a callable that raises as soon as it is called, so a code path that really needs a
kernel fails loudly instead of computing garbage. The exception: the ops of SGLang's
speculative decoding on CPU, which have torch-native twins in `speculative.py` (checked against
their GPU definitions in tests/test_spec_cpu.py), and, only with FARSKIP_CPU_AMX_TWINS=1, the
ops of SGLang's AMX CPU path, registered as torch ops by `amx.py` (there: why, and what is
covered) so FarSkip can be tested on that path without the real kernel build; slow, not for
serving.

It is only put on sys.path by the CPU install (scripts/bootstrap.sh writes a .pth file that
appends this directory *after* site-packages), so a real sgl_kernel always wins.
"""

import importlib.abc
import importlib.machinery
import sys
import types

IS_FARSKIP_CPU_STAND_IN = True
_FIX = (
    "this machine has no sgl_kernel build (sglang_farskip's CPU stand-in is installed): "
    "run on a GPU node with SGLang's own image, or keep the CPU path on torch-native ops "
    "(--device cpu --attention-backend torch_native, which sglang_farskip.serve.launcher sets)"
)


class MissingKernel:
    """A kernel that does not exist here. Importing it is fine; calling it is an error."""

    def __init__(self, qualname: str):
        self.__qualname__ = self.__name__ = qualname

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{self.__qualname__} was called, but {_FIX}")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self.__qualname__}.{name}")

    def __repr__(self) -> str:
        return f"<missing sgl_kernel.{self.__qualname__}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    # The speculative-decoding ops SGLang's CPU branches import from the top level have
    # torch-native twins (speculative.py); everything else still raises when called.
    from sgl_kernel.speculative import TWINS

    if name in TWINS:
        return TWINS[name]
    return MissingKernel(name)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self.__name__.partition('.')[2]}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`from sgl_kernel.scalar_type import ScalarType` and friends get a stub submodule."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())

# Opt-in, at import: SGLang decides whether to take its AMX path when its modules are imported,
# by asking whether torch.ops.sgl_kernel.convert_weight_packed exists right after importing
# this package (sglang/srt/utils/common.py, _is_intel_amx_backend_available).
# (`from sgl_kernel import amx` would get a MissingKernel from __getattr__ above.)
from sgl_kernel.amx import enabled as _amx_enabled, register as _amx_register  # noqa: E402

if _amx_enabled():
    _amx_register()
