"""The module-pattern language under its former name; it lives in `meshforge.utils.patterns`.

Kept only for `parallel/expert_generic.py`, which the generic-family move (`models/generic/`)
replaces; delete this module with it. New code imports `meshforge.utils.patterns`.
"""

from meshforge.utils.patterns import ModulePattern, compile_pattern, is_pattern, match_modules, suggest_names

__all__ = ["ModulePattern", "compile_pattern", "is_pattern", "match_modules", "suggest_names"]
