"""Trees grown on the device with no host read: ``lookup`` from the context alone, ``hybrid`` with the head's rounds;
each equal, node for node, to the host's best-first builder (``tree/best_first``)."""
