"""The wire format, with no I/O: everything here is testable on a ``bytearray``.

``codec`` (Encoder / Decoder) and ``ext`` (the Ext table), ``lift`` (the pass that
lifts typed leaves out of untyped positions), ``leaves`` (sets, dates, UUIDs,
decimals: Ext 12-19), ``sglang`` (the codec profile that speaks SGLang's dialect),
``record`` (the Record base), ``dtypes`` (the dtype allow-lists), ``descriptors`` (Ext 4 / 5 references),
``ring`` (SPSC ring lanes over any buffer: frames, fences, the eventcount),
``slotlayout`` (slot pools over any buffer: states, generations), ``control`` (the
control socket's messages and the sans-I/O handshake state machine, doorbell bytes,
the one version negotiation), ``broadcast_control`` / ``broadcast_ring`` (a
broadcast's join and its ring), ``net_control`` (the TCP transport's rendezvous and
control messages), ``netstatus`` (the TCP status table's layout),
``names`` (segment names), ``envelope`` (the calls' envelope), ``release`` (the finalizer-safe release queue).
"""

# the "sglang" codec profile: Encoder(profile="sglang") / Decoder(profile="sglang") make
# the classes of .sglang, which register themselves with .codec when they are made (so
# .codec never imports .sglang, which builds on it)
from . import sglang  # noqa: E402, F401
