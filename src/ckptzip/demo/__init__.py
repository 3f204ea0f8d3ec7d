"""Real workloads (models + data that ship on every machine) and the fault-tolerant demo."""
