"""meshforge.optim: see docs/architecture.md for what lives here."""
