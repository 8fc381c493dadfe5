"""The queue: its rules (fair share, the plan), a queued job's request, the scheduler."""
