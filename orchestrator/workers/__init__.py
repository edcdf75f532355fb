"""The workers of a run: the worker actor (one rank), the group the controller drives, call results, the memory
tier's restore over Ray, and the hang probe."""
