"""A job's log: stored in chunks and read back, published live, streamed as events."""
