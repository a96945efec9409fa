"""Pictures of plans and schedules: the HTML report, PNG charts, chrome traces."""
