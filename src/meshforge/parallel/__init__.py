"""meshforge.parallel: see docs/architecture.md for what lives here."""
