"""Helpers shared by the test suites (real servers started on 127.0.0.1, stopped by PID)."""
