"""meshforge.monitor: see docs/architecture.md for what lives here."""
