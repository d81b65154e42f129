"""Hooks for training frameworks (imported lazily: each pulls in its framework only when used)."""
