"""The shared-memory transport: what moves bytes between processes on one host.

``segment`` (POSIX shared memory: create, attach, unlink, sweep), ``sockets`` (Unix
sockets: peer credentials, listening), ``handshake`` (one generator per role, sync and
async drivers), ``transport`` (:class:`ShmTransport`: two ring lanes and a control
socket, the first implementation of :mod:`ringwire._conn.transport`), the tensor-slot
pools -- ``slotconfig`` (configuration, pool segments), ``sendpool`` (the producer:
placing, loans, releases, receipts), ``recvpool`` (the consumer: resolving, finalizers),
``views`` (release / borrow / copy_out) -- ``cuda`` (GPU slot pools, Ext 5) and ``cudablocks`` (their exported blocks:
one export per connection, leases, release of torch's IPC counter).
"""
