"""The Flower engine for real deployments (``fedcontrast flower ...``): a SuperLink at the operator,
a SuperNode per site. Needs the extra ``[flower]``; the simulator's Flower executor is
:mod:`fedcontrast.sim.flower_executor`."""
