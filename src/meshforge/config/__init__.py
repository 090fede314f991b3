"""meshforge.config: see docs/architecture.md for what lives here."""
