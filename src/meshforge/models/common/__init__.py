"""meshforge.models.common: see docs/architecture.md for what lives here."""
