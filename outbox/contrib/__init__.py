"""Integrations with application frameworks (optional; each needs its framework)."""
