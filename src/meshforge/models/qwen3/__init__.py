"""meshforge.models.qwen3: see docs/architecture.md for what lives here."""
