"""meshforge.memory: see docs/architecture.md for what lives here."""
