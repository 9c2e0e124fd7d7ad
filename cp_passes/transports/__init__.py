"""Transports: how sequence data moves between ranks. One module per transport; see :mod:`.base`.

Importing this package registers the built-in transports, in order: positions (no communication),
shift, halo, scan, splice, carry, sequence_gather, key_gather, reductions, picks, eager_modules (moves nothing).
"""

from .base import TRANSPORTS, Cost, Transport, collective_ops, in_order, register_transport, unregister_transport
from .carry import CARRY
from .eager_modules import EAGER
from .gather import SEQUENCE_GATHER
from .halo import HALO
from .keys import KEY_GATHER
from .picks import PICKS
from .positions import POSITIONS
from .reductions import REDUCTIONS
from .scan import SCAN
from .shift import SHIFT
from .splice import SPLICE

__all__ = ["CARRY", "Cost", "EAGER", "HALO", "KEY_GATHER", "PICKS", "POSITIONS", "REDUCTIONS", "SCAN",
           "SEQUENCE_GATHER", "SHIFT", "SPLICE", "TRANSPORTS", "Transport", "collective_ops", "in_order",
           "register_transport", "unregister_transport"]
