"""Pictures of plans and schedules: chrome traces of pipeline timelines."""
