"""Offline tools: the built-in demo checkpoints (demo_model), checkpoint conversion (convert) and
the patches/ applier (patches)."""
