"""fedcontrast: contrastive and representation-sharing federated learning on OpenFL.

The algorithm core (data, models, losses, aggregation rules, plugins, simulator) does not import
OpenFL; the OpenFL glue is a thin adapter over the same plugin calls.
"""

__version__ = "0.1.0"
