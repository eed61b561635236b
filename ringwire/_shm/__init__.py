"""The shared-memory transport: what moves bytes between processes on one host.

``sockets`` (Unix sockets: peer credentials, listening), ``handshake`` (one generator
per role, sync and async drivers), ``transport`` (:class:`ShmTransport`: two ring lanes
and a control socket, the first implementation of :mod:`ringwire._conn.transport`), the
shared-memory slot pools -- ``sendpool`` (the producer: placing, loans, releases,
receipts), ``recvpool`` (the consumer: resolving, finalizers) -- and the broadcast ring
(``broadcast``, ``broadcast_pool``, ``broadcast_reader``).  What the pools share with
the TCP transport's (configuration, the pool protocols, received views, the CUDA
backend, segments) is :mod:`ringwire._pool`, below both; this package never imports
:mod:`ringwire._net`, nor it this one.
"""
