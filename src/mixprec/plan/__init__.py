"""Per-layer precision chosen by measurement, in one package: the [plan] table (config),
each Linear layer's three GEMMs measured on real tensors (measure), a format chosen per
layer (choose), the planner that runs the steps and writes the plan (planner), the plan
file and its reader (file), and re-planning during a run (live)."""
