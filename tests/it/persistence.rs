//! Persistence (REQ-BED-007): transactions, counters, recovery, both backends.
