"""meshforge.checkpoint: see docs/architecture.md for what lives here."""
