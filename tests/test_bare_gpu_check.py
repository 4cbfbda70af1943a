"""The bare GPU check's premise, on a CPU: FarSkip's collectives and spec need torch alone.

The GPU machine this project may be lent has torch, NCCL and numpy but no SGLang, and nothing
can be installed there. So a virtualenv here holds only torch, numpy and safetensors (and what
they import), and in it: sglang is not importable, `sglang_farskip.comm` and `.reference`
import, `python/sglang_farskip/checks/gpu.py --help` works, and its CPU part (the FarSkip stack through
`Communicator` over a 2-rank gloo world) passes, including its broken-lane controls, while
`--break-lane` in the main runs makes it fail. Also the NCCL binding's ABI-facing pieces
(ncclConfig_t layout, version gate, library lookup) and, where the wheel's libnccl loads here,
the library calls that need no GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "torch"))))
# torch (and torchgen, shipped in its wheel), its own imports on a CPU (typing_extensions ..
# fsspec), numpy and safetensors, and the CUDA libraries a CUDA build of torch links against
# (nvidia/, NCCL included), which load without a GPU.
PACKAGES = ("torch", "torchgen", "numpy", "numpy.libs", "safetensors", "typing_extensions.py", "sympy",
            "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "nvidia")
NOT_THERE = ("sglang", "sgl_kernel", "flashinfer", "triton", "transformers")


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """(python, env) of a venv with only PACKAGES, and this repository's python/ on its path
    (as gpu_check.py puts it there itself: no install)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                    str(venv)], check=True, timeout=60)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    for name in PACKAGES:
        src = SITE / name
        if src.exists():
            (site / name).symlink_to(src)
    for info in SITE.glob("*.dist-info"):  # importlib.metadata lookups of the linked packages
        if info.name.split("-")[0].lower().replace("_", "-") in {
                "torch", "numpy", "safetensors", "typing-extensions", "sympy", "mpmath", "networkx",
                "jinja2", "markupsafe", "filelock", "fsspec"} or info.name.startswith("nvidia"):
            (site / info.name).symlink_to(info)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONNOUSERSITE": "1", "PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1"}
    return str(venv / "bin" / "python"), env


def _run(bare, *argv, timeout=120):
    python, env = bare
    return subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT), env=env)


def test_comm_and_reference_import_without_sglang(bare):
    code = (
        "import importlib.util, sys\n"
        f"missing = [m for m in {NOT_THERE!r} if importlib.util.find_spec(m) is None]\n"
        "import sglang_farskip.comm, sglang_farskip.reference, sglang_farskip.nccl, sglang_farskip.schedule\n"
        "import torch\n"
        "print('MISSING', ','.join(missing))\n"
        "print('LOADED', ','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'sgl_kernel'))))\n"
        "print('TORCH', torch.__file__)\n"
    )
    proc = _run(bare, "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) if " " in line else (line, "") for line in proc.stdout.splitlines())
    assert out["MISSING"].split(",") == list(NOT_THERE), out  # the venv really is bare
    assert out["LOADED"] == ""
    assert out["TORCH"].startswith(str(Path(bare[0]).parents[1])), out["TORCH"]  # via the venv


def test_gpu_check_help(bare):
    proc = _run(bare, "-m", "sglang_farskip.checks.gpu", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--cpu", "--world", "--json", "--ops-json", "--break-lane", "--items"):
        assert flag in proc.stdout


def test_gpu_check_cpu_parts_pass_and_controls_have_power(bare, tmp_path):
    out = tmp_path / "check.json"
    proc = _run(bare, "-m", "sglang_farskip.checks.gpu", "--cpu", "--world", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "PASS stack" in proc.stdout and "SUMMARY PASS" in proc.stdout, proc.stdout
    ranks = json.loads(out.read_text())["stack"]["ranks"]
    assert [r["backends"] for r in ranks] == [{"sync": "blocking", "overlap": "comm-thread"}] * 2
    for rank in ranks:
        for n, res in rank["tokens"].items():
            assert res["wiring_err"] < 1e-4, (n, res["wiring_err"])
            assert res["runs"]["overlap-eager"]["bitwise"], n
            # Both controls broke the result by far more than the tolerance: the check can fail.
            assert set(res["controls"]) == {"drop-partial", "skip-join"}
            for name, ctl in res["controls"].items():
                assert ctl["detected"] and ctl["err"] > 3 * res["tol"], (n, name, ctl, res["tol"])


@pytest.mark.parametrize("broken, world", [("drop-partial", "1"), ("skip-join", "2")])
def test_gpu_check_fails_with_a_broken_lane(bare, broken, world):
    # skip-join needs a real join to skip: the 2-rank comm thread (the identity backend's sum is ready).
    proc = _run(bare, "-m", "sglang_farskip.checks.gpu", "--cpu", "--world", world, "--break-lane", broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "FAIL stack" in proc.stdout and "SUMMARY FAIL: stack" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ the binding, in-process
from sglang_farskip import nccl  # noqa: E402


def test_config_layout_is_nccl_2_18():
    # nccl.h (2.18): size_t size; unsigned magic, version; int blocking, cgaClusterSize,
    # minCTAs, maxCTAs; const char *netName; int splitShare.
    offsets = {name: getattr(nccl.Config, name).offset for name, _ in nccl.Config._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20,
                       "minCTAs": 24, "maxCTAs": 28, "netName": 32, "splitShare": 40}
    assert ctypes.sizeof(nccl.Config) == 48 and ctypes.sizeof(nccl.UniqueId) == 128
    cfg = nccl.make_config(22105, 8)
    assert (cfg.size, cfg.magic, cfg.version, cfg.maxCTAs) == (48, 0xCAFEBEEF, 21800, 8)
    assert cfg.blocking == cfg.minCTAs == cfg.splitShare == -(2**31)  # NCCL_CONFIG_UNDEF_INT


def test_cta_cap_refused_where_nccl_has_none():
    with pytest.raises(nccl.NcclError, match=r"needs NCCL 2.17 or newer, this library is 2.16.5"):
        nccl.make_config(21605, 8)
    with pytest.raises(nccl.NcclError, match="at least 1"):
        nccl.make_config(21800, 0)
    assert nccl.version_string(2708) == "2.7.8" and nccl.version_string(23007) == "2.30.7"


def test_library_lookup_names_what_it_tried(monkeypatch, tmp_path):
    missing = str(tmp_path / "libnccl-nope.so")
    monkeypatch.setenv(nccl.ENV_LIBRARY, missing)
    assert nccl.library_candidates() == [missing]
    with pytest.raises(nccl.NcclError, match=r"tried: .*libnccl-nope.so \(no such file\).*FARSKIP_NCCL_LIBRARY"):
        nccl.NcclLibrary()
    monkeypatch.delenv(nccl.ENV_LIBRARY)
    candidates = nccl.library_candidates()
    assert candidates[-1] == "libnccl.so.2"
    assert str(SITE / "nvidia" / "nccl" / "lib" / "libnccl.so.2") in candidates


def test_library_calls_that_need_no_gpu():
    try:
        lib = nccl.NcclLibrary()
    except nccl.NcclError as e:
        pytest.skip(f"no NCCL library here: {e}")
    assert lib.version >= 21800, lib.version_string
    uid = lib.get_unique_id()
    assert len(uid) == 128 and uid != bytes(128)
    with pytest.raises(nccl.NcclError, match=r"ncclFoo failed: invalid argument .*ncclResult_t 4"):
        lib._check(4, "ncclFoo")
    with pytest.raises(nccl.NcclError, match="128 bytes"):
        lib.comm_init_rank(1, b"short", 0)


def test_gpu_check_arguments():
    from sglang_farskip.checks import gpu as gc
    args = gc.parse_args(["--items", "stack,ops", "--json", "x.json"])
    assert args.items == ["stack", "ops"] and args.json == "x.json" and not args.cpu
    for bad in (["--items", "stack,nope"], ["--layers", "1"], ["--world", "3"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)
    # The TP=8 and TP=16 shards of DeepSeek-V3 split evenly, as the stack assumes.
    for tp in (8, 16):
        a = gc.model_args(gc.DSV3, tp)
        assert a.num_attention_heads * tp == 128 and gc.DSV3.experts % tp == 0
        assert gc.DSV3.inter % tp == 0 and gc.DSV3.moe_inter % tp == 0
