"""Example training scripts that use the session API."""
