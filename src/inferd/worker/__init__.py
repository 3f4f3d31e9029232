"""The worker process (one per device): its main loop, its links to the front ends it serves, its device,
and the local launchers that start and restart worker processes."""
