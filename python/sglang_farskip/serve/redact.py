"""Keep the API keys, and every other secret a server setting can hold, out of everything SGLang
writes down or answers.

SGLang 0.5.23 hides only its watermark secrets. Every place that writes the server's settings
out goes through one of two functions of `sglang/srt/sampling/watermarking/core.py`:
- `redact_watermark_secrets(value)`: the start-up `server_args=` log line (entrypoints/engine.py),
  the answers of `/server_info` and `/get_server_info` (entrypoints/http_server.py), the
  configuration and requests in a crash dump (managers/tokenizer_manager.py);
- `redact_watermark_command_line(argv, ...)`: the launch command kept on the ServerArgs
  (server_args.py, `launch_command`), shown by `/server_info` and written into crash dumps.
Two more print settings with neither: `ServerArgs.__repr__`, and
`TokenizerManager._server_args_for_dump`, which hands the ServerArgs object itself to a crash
dump unless watermarking is on.

The four AROUND hooks below (rows of sglang_farskip/boundary/table.csv, installed through SGLang's
HookRegistry by the plugin and applied by `load_plugins()` in every SGLang process, the
launcher's included, before any of them runs) make each setting of SECRET_FIELDS, and its flag
on the command line, read `<redacted>` wherever the watermark secrets do.
Nothing else changes: the running server keeps and uses its settings as before.
"""

from __future__ import annotations

import ctypes
import logging
import os

# The ServerArgs fields that can hold a secret (SGLang 0.5.23's fields, read end to end; the
# watermark's own are SGLang's to hide), each with what it holds:
SECRET_FIELDS = frozenset({
    "api_key", "admin_api_key",  # the inference and admin keys
    "ssl_keyfile_password",  # decrypts the TLS private key
    # JSON for a KV-cache storage backend or linker (Mooncake, 3FS, S3-like stores): their
    # endpoints' credentials go here.
    "hicache_storage_backend_extra_config", "unified_cache_external_linker_config",
    "model_loader_extra_config",  # JSON for the weight loader, remote stores' credentials included
    "sidecar_args",  # the command line of a sidecar program, a token of its own included
})
# Each as a flag (SGLang's CLI name is the field's, with dashes), longest first.
SECRET_FLAGS = tuple(sorted((f"--{name.replace('_', '-')}" for name in SECRET_FIELDS), key=len, reverse=True))
# SGLang's flags that begin another's secret flag but hold no secret: an exact match is not an
# abbreviation (tests/test_secrets.py checks this list against SGLang's parser).
NOT_SECRET_FLAGS = frozenset({"--ssl-keyfile", "--hicache-storage-backend", "--model", "--sidecar"})
REDACTED = "<redacted>"
# The environment variables a key may reach the launcher in (its flag: the variable); with the
# suffix _FILE, a file holding it (serve/launcher.py reads both; serve/watchdog.py keeps the
# first out of its own environment).
KEY_VARIABLES = {"--api-key": "FARSKIP_API_KEY", "--admin-api-key": "FARSKIP_ADMIN_API_KEY"}


def scrub(value):
    """`value` with every dict entry named in SECRET_FIELDS that holds something replaced by
    REDACTED, at any depth (dicts, lists, tuples); other values are returned as they are."""
    if isinstance(value, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v not in (None, "", {}, []) else scrub(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [scrub(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _is_secret_flag(word: str) -> bool:
    """A flag of SECRET_FLAGS, or an abbreviation argparse would accept for one (SGLang's parser
    takes any unambiguous prefix)."""
    return (word.startswith("--") and len(word) > 2 and word not in NOT_SECRET_FLAGS
            and any(f.startswith(word) for f in SECRET_FLAGS))


def scrub_argv(argv) -> list[str]:
    """argv with the value of every secret flag (`--api-key KEY`, `--api-key=KEY`, also
    abbreviated) replaced by REDACTED (each takes one value)."""
    out, hide_next = [], False
    for word in argv:
        word = str(word)
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif "=" in word and _is_secret_flag(word.split("=", 1)[0]):
            out.append(f"{word.split('=', 1)[0]}={REDACTED}")
        else:
            out.append(word)
            hide_next = _is_secret_flag(word)
    return out


def redact_secrets(original, value, *args, **kwargs):
    return scrub(original(value, *args, **kwargs))


def redact_command_line(original, argv, *args, **kwargs):
    return original(scrub_argv(argv), *args, **kwargs)


def repr_without_keys(original, server_args):
    text = original(server_args)
    for name in SECRET_FIELDS:
        value = getattr(server_args, name, None)
        if value is not None:
            text = text.replace(f"{name}={value!r}", f"{name}={REDACTED!r}")
    return text


def dump_without_keys(original, tokenizer_manager):
    dumped = original(tokenizer_manager)
    if isinstance(dumped, dict):
        return scrub(dumped)
    # The ServerArgs object itself: dump its settings as a dict instead, as upstream does
    # when watermarking is on (the dump's reader accepts both).
    return scrub(dumped.resolved_dict())


def take_from_environment(name: str) -> str | None:
    """Read the secret in environment variable `name` once and remove it from this process,
    so that no process started from here on inherits it. None if unset.

    Removing it from `os.environ` is not enough: /proc/PID/environ shows the block the process
    was started with, and SGLang's CPU workers are forked (they copy that block). So the bytes of
    `NAME=value` in that block are overwritten too; nothing points at them once the variable is
    unset (Python keeps its own copy, which `pop` drops)."""
    value = os.environ.pop(name, None)  # also unsetenv(3): the libc view
    if value is None:
        return None
    try:
        _zero_in_initial_environment(f"{name}={value}".encode())
    except (OSError, ValueError) as e:  # e.g. no /proc: the variable is still unset
        logging.getLogger(__name__).warning("could not clear %s from /proc/self/environ: %s", name, e)
    return value


def _zero_in_initial_environment(entry: bytes) -> None:
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # Fields 50 and 51 of proc(5), env_start and env_end; fields[0] here is field 3 (state).
    env_start, env_end = int(fields[47]), int(fields[48])
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    offset = 0
    while (offset := block.find(entry, offset)) != -1:
        if offset == 0 or block[offset - 1] == 0:  # a whole entry, not the tail of another
            if env_start + offset + len(entry) > env_end:
                raise ValueError("entry beyond env_end")
            ctypes.memset(env_start + offset, 0, len(entry))
        offset += len(entry)
