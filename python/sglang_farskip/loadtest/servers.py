"""Facts about the servers under test and the machine, for checks before a run and for the
report's note; and the short warm-up each server gets before its first level."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


class BenchError(Exception):
    """Bad input or an unusable server: printed as one `error:` line, exit code 2."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What a server started with an API key wants on every request but /health* and /metrics."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unauthorized(url: str, api_key: str | None) -> BenchError:
    """The error for an HTTP 401, naming the fix."""
    fix = ("the server wants an API key: pass --api-key or set API_KEY" if not api_key
           else "the API key given (--api-key or API_KEY) is not the server's")
    return BenchError(f"{url} answered HTTP 401 Unauthorized: {fix}")


def get_json(url: str, api_key: str | None = None, timeout: float = 5.0):
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers(api_key)),
                                timeout=timeout) as r:
        return json.loads(r.read())


def check_reachable(label: str, url: str) -> None:
    """Fail in seconds, not after a whole load run of connection errors."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5.0) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise BenchError(f"{label}: {url}/health answered HTTP {e.code}: the server is up but not "
                         "healthy; check its log") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BenchError(f"{label}: cannot reach the server at {url} ({reason}): start it "
                         "(python -m sglang_farskip.launch_server --port PORT) or fix the URL") from None


def server_facts(url: str, api_key: str | None = None) -> dict:
    """What the report says about a server; each source is optional (stock SGLang has no
    /farskip/info, other servers have neither)."""
    facts: dict = {"url": url}
    try:
        info = get_json(url + "/get_server_info", api_key)
        for key in ("version", "model_path", "tokenizer_path", "device", "tp_size", "stream_interval",
                    "max_running_requests", "enable_metrics", "sleep_on_idle", "disable_radix_cache",
                    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens", "ep_size", "nnodes", "dp_size", "enable_dp_attention",
                    "disaggregation_mode"):
            facts[key] = info.get(key)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise unauthorized(url + "/get_server_info", api_key) from None
    except (urllib.error.URLError, OSError, ValueError):
        pass
    try:
        fs = get_json(url + "/farskip/info", api_key)
        rank = (fs.get("ranks") or [{}])[0]
        facts["farskip_mode"] = rank.get("mode")
        facts["farskip"] = rank.get("description")
        facts["pd_role"] = (fs.get("launcher") or {}).get("pd_role")
    except (urllib.error.URLError, OSError, ValueError):
        facts["farskip_mode"] = None
    if facts.get("pd_role") is None and facts.get("disaggregation_mode") is not None:
        # Stock SGLang has no /farskip/info: its own flag says the same ("null": both phases).
        facts["pd_role"] = facts["disaggregation_mode"] if facts["disaggregation_mode"] in ("prefill", "decode") else "none"
    return facts


def layout(facts: dict) -> str:
    """A server's parallel layout as the report names it, e.g. "TP=2, 2 nodes"."""
    parts = [f"TP={facts.get('tp_size') or 1}"]
    if (facts.get("ep_size") or 1) > 1:
        parts.append(f"EP={facts['ep_size']}")
    if facts.get("enable_dp_attention"):
        parts.append(f"DP attention {facts.get('dp_size')}")
    nodes = facts.get("nnodes") or 1
    parts.append(f"{nodes} node{'s' if nodes > 1 else ''}")
    return ", ".join(parts)


def machine_facts() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem_gib = round(kib / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    gpu = "none"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        gpu = ", ".join(line.strip() for line in q.stdout.splitlines() if line.strip()) or "none"
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": mem_gib, "gpu": gpu,
            "os": platform.platform(), "python": platform.python_version()}


def warm_up(url: str, args, n: int) -> None:
    """A few short requests first: the first request after start pays one-off costs."""
    api_key = getattr(args, "api_key", None)  # crosscheck_sglang.py's args have none
    for k in range(n):
        ids = [2 + k + i for i in range(min(args.input_len, 64))]  # no prefix shared between them
        if args.endpoint == "generate":
            path, body = "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        else:
            path, body = "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0}
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **auth_headers(api_key)})
        try:
            with urllib.request.urlopen(req, timeout=args.request_timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise unauthorized(url + path, api_key) from None
            raise BenchError(f"warm-up request to {url}{path} failed: HTTP {e.code} "
                             f"{e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise BenchError(f"warm-up request to {url}{path} failed ({getattr(e, 'reason', e)}); "
                             "check the server's log, or skip warm-up with --warmup 0") from None
