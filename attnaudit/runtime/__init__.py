"""Where and how things run: device, threads, executors and sweeps, atomic writes."""
