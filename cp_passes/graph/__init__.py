"""FX graph helpers shared by every layer: sequence analysis and provenance tags."""
