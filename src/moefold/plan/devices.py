"""The GPUs `moefold plan memory --device` knows; data only, so the command line's parser reads it
without importing torch."""

DEVICES_GB = {"h100": 80, "h200": 141, "b200": 180, "gb200": 186}
"""Memory per GPU as marketed, in GB (10^9 bytes)."""
