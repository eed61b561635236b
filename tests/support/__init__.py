"""Helpers shared by the test folders: imported as ``support.<module>`` (tests/ is on
sys.path: pytest puts the root conftest's folder there, and spawned children inherit it)."""
