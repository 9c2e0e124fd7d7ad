"""Per-model-family CPSpecs; load one with cp_passes.load_spec(name)."""
