"""`python -m sglang_farskip.launch_server`: the launcher's public name (serve/launcher.py)."""

from sglang_farskip.serve.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
