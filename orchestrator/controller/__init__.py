"""One run's controller: the loop and its states, what it tells (observers, status), the run's own failure and
size policy, its membership, drains and the autoscaler's demand, and the Ray actor around it."""
