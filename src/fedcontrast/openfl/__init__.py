"""The OpenFL 1.9 glue: thin adapters that drive the same plugin calls the simulator makes.

Nothing here holds algorithm logic. ``runner.PluginTaskRunner`` exposes each collaborator task of
the configured plugin as an OpenFL task; ``aggregation.PluginAggregation`` runs the plugin's
aggregator task over every upload of the round; ``components`` makes failures end the federation
with a clear message instead of hanging; ``plan`` writes plans from the typed run configuration.
Importing this package does not import OpenFL; its modules do.
"""
