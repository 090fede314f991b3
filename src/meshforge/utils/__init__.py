"""meshforge.utils: see docs/architecture.md for what lives here."""
