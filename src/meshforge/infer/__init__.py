"""meshforge.infer: see docs/architecture.md for what lives here."""
