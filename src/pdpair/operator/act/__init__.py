"""The executor: API calls, the port leaser, pushes, probes, scrapes, Events, leader election, metrics."""
