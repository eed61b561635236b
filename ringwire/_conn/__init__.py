"""Connections: one endpoint core behind a transport seam, and two thin drivers.

Read :mod:`.transport` first (the endpoint's states and what a transport guarantees),
then :mod:`.endpoint` (every operation that does not wait), :mod:`.waits` (every loop
that does), and the drivers :mod:`.async_channel` and :mod:`.sync_channel`, which only
perform the waits.  :mod:`.listener` / :mod:`.sync_listener`, :mod:`.connect` and
:mod:`.pair` make connections, with the keywords :mod:`.options` checks for all of
them; :mod:`.memory` is an in-memory transport for tests.
"""
