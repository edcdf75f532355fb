"""The Ray side of etrain: controller, worker group, policies, run store and CLI."""
