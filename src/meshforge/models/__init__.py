"""meshforge.models: see docs/architecture.md for what lives here."""
