"""What every transport's tensor pools share: the layer below ``_shm`` and ``_net``.

A connection may carry large arrays beside its records instead of inline: the sender
places them in a *send pool*, the receiver resolves the references into views through
the peer's *receive pool*.  How the bytes move is the transport's (shared-memory slots
in :mod:`ringwire._shm`, ZeroMQ frames or NIXL reads in :mod:`ringwire._net`); what is
the same for every transport lives here, and neither transport imports the other:

``slotconfig`` (:class:`~ringwire.SlotConfig`: slot classes, policies, thresholds,
loans; the layout of a pool segment), ``protocols`` (the :class:`SendPool` /
:class:`RecvPool` seams the endpoint talks to, and :data:`Placed`), ``views`` (the
registry of received views, :data:`HELD`, and ``release`` / ``borrow`` / ``copy_out``),
``cuda`` and ``cudablocks`` (the CUDA backend: GPU pools, their exported blocks and
leases), ``segment`` (POSIX shared-memory segments: the memory of a slot pool, and of
this process's TCP status table).
"""
