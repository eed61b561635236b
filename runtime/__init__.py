"""ringwire's process runtime: topologies of worker processes wired by channels.

Not built yet: it arrives with the process-runtime issue.  Importing this package is
harmless; it exports nothing.
"""

__all__: list[str] = []
