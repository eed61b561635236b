"""The TCP transport: the same channels between hosts, over ZeroMQ (pyzmq).

A layer beside :mod:`ringwire._shm` (neither imports the other; what their tensor
pools share is :mod:`ringwire._pool`): :mod:`.transport` implements the transport seam
(:mod:`ringwire._conn.transport`) on one ZeroMQ ``PAIR`` socket per connection,
:mod:`.pools` carries arrays beside the record as frames of their own (Ext 20),
:mod:`.handshake` connects and accepts (what a peer sends is parsed, with no I/O, by
:mod:`ringwire._wire.net_control`: the fuzz targets drive it); :mod:`.status` keeps
this process's table of its TCP connections for ``python -m ringwire inspect`` (which
also asks the kernel, :mod:`.sockdiag`); :mod:`.keys` reads CURVE key files (and is
``python -m ringwire keygen``) and :mod:`.curve` puts them on the sockets and reports
refusals; :mod:`.nixl` and :mod:`.nixlpools` move large tensors through NIXL where
both ends have it.  ``ringwire.connect("tcp://host:port")`` and
``ringwire.listen("tcp://0.0.0.0:port")`` route here (:mod:`ringwire._conn.connect`).
pyzmq is an optional extra (``ringwire[net]``), imported only when a ``tcp://``
address is used.
"""
