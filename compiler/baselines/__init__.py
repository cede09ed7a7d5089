"""The mutable baseline: the pre-fix ``ScheduleBatch`` lifecycle (bug included) and a speculative
engine over it, for side-by-side runs. Product code never imports this package; the tools do."""
