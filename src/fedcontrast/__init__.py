"""fedcontrast: contrastive and representation-sharing federated learning, in a simulator, on OpenFL
and on Flower.

The algorithm core (data, models, losses, aggregation rules, plugins, simulator) imports no federation
engine; the OpenFL and Flower glue are thin adapters over the same plugin calls.
"""

__version__ = "0.1.0"
