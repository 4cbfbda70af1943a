#!/usr/bin/env bash
# The install step every image runs (docker/Dockerfile.{rocm,cuda,cpu}): put sglang-farskip
# into a Python that already has torch and SGLang, without touching either, and apply patches/.
#
#   install-farskip.sh PLATFORM SRC SGLANG_VERSION      (PLATFORM: rocm, cuda or cpu)
#
# It fails the build, with the reason, when the base image is not what the versions file says:
# another SGLang version, or a torch built for another platform.
set -euo pipefail

if (($# != 3)); then
  echo "usage: $0 rocm|cuda|cpu SRC SGLANG_VERSION" >&2
  exit 2
fi
platform="$1" src="$2" want_sglang="$3"
python="${FARSKIP_PYTHON:-python3}"
pip=("$python" -m pip install --no-cache-dir --no-input --disable-pip-version-check)
# The upstream images install into the system Python, not a venv; where the distribution marks
# it externally managed (PEP 668), pip refuses to install without this.
export PIP_BREAK_SYSTEM_PACKAGES=1

have_sglang="$("$python" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
if [[ "$have_sglang" != "$want_sglang" ]]; then
  echo "error: the base image has sglang $have_sglang, sglang-farskip needs $want_sglang:" \
    "fix the image tag in docker/versions.env" >&2
  exit 1
fi
torch_before="$("$python" -c 'import torch; print(torch.__version__)')"
case "$platform" in
  rocm) probe='import sys, torch; sys.exit(not torch.version.hip)' ;;
  cuda) probe='import sys, torch; sys.exit(not (torch.version.cuda and not torch.version.hip))' ;;
  cpu) probe='import torch' ;;
  *) echo "error: platform $platform is not rocm, cuda or cpu" >&2; exit 2 ;;
esac
if ! "$python" -c "$probe"; then
  echo "error: torch $torch_before in the base image does not match platform $platform:" \
    "build docker/Dockerfile.$platform from the $platform image named in docker/versions.env" >&2
  exit 1
fi

# Prefill/decode disaggregation (docs/pd.md) moves the KV cache with Mooncake's transfer engine,
# which the upstream GPU images ship (the CUDA image pip-installs its RDMA build, the ROCm image
# builds it from source). Checked here, not at the first PD request: a base without it fails the
# build with the fix. Its files, not an import: engine.so links the GPU driver, which a build
# has no access to.
if [[ "$platform" != cpu ]] && ! mooncake="$("$python" - <<'PY'
import importlib.metadata as m, importlib.util, pathlib, sys
spec = importlib.util.find_spec("mooncake")  # finds the package without importing it
dirs = (spec.submodule_search_locations if spec else None) or ()
engines = [p for d in dirs for p in pathlib.Path(d).glob("engine*.so")]
if not engines:
    sys.exit(1)
dists = [d for d in m.distributions() if (d.metadata["Name"] or "").lower().startswith("mooncake")]
print(", ".join(f"{d.metadata['Name']} {d.version}" for d in dists) or "(no distribution record)", "at", engines[0])
PY
)"; then
  echo "error: the base image has no Mooncake transfer engine (no mooncake/engine*.so), which" \
    "prefill/decode disaggregation needs: use the upstream $platform image named in" \
    "docker/versions.env, or add Mooncake's $platform build to docker/Dockerfile.$platform" \
    "(docs/deploy.md, \"Mooncake in the GPU images\")" >&2
  exit 1
fi
[[ "$platform" == cpu ]] || echo "Mooncake: $mooncake"

# Build and install this package with nothing fetched but the hash-checked setuptools:
# - setuptools (pyproject.toml's exact pin) from requirements/build.lock, into a scratch
#   directory on PYTHONPATH rather than the image's Python, whose own setuptools stays as it is;
# - --no-build-isolation: pip would otherwise fetch the build backend itself, unhashed;
# - --no-index: nothing else can come from an index, so an unpinned fetch fails the build;
# - --no-deps: the package's declared dependencies are SGLang's and torch's own, which the
#   image already has in the builds it was tested with; a resolver run could replace them.
build_deps="$(mktemp -d)"
"${pip[@]}" --require-hashes --no-deps --target "$build_deps" -r "$src/requirements/build.lock"
PYTHONPATH="$build_deps" "${pip[@]}" --no-deps --no-build-isolation --no-index "$src"
rm -rf "$build_deps" "$src/build"
# The same command as every other install (scripts/bootstrap.sh, CI): patches SGLang in place.
"$python" -m sglang_farskip.tools.patches apply

torch_after="$("$python" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_after" != "$torch_before" ]]; then
  echo "error: installing sglang-farskip changed torch $torch_before to $torch_after" >&2
  exit 1
fi
"$python" -c 'import sglang_farskip, sys; print("sglang-farskip", sglang_farskip.__version__, "on", sys.version.split()[0])'
