"""meshforge.data: see docs/architecture.md for what lives here."""
