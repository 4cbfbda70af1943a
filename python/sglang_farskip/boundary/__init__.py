"""Where sglang_farskip meets SGLang, in one place.

    table.csv    every touch point, one line each: hooks, replacements, registry entries,
                 subclasses, class swaps, environment switches SGLang reads, private attributes
                 read; with owner and reason
    table.py     reads and validates it (the Row type, the kinds, the install groups)
    installer.py puts the installed rows in place (the only module that writes into SGLang),
                 says which are missing, swaps classes as the table allows
    check.py     the upgrade check against the installed SGLang (`python -m sglang_farskip.boundary check`)
"""

from sglang_farskip.boundary.installer import apply, install, missing, swap_class

__all__ = ["apply", "install", "missing", "swap_class"]
